"""The gradient tier (ZeRO-Offload, ZeRO-Infinity): reduced gradient slices leave the device
as they land, for the tier of the master tiles they belong to.

    bucket slice's tiles    its gradient                          on the device
    all DEVICE              the ShardGradient piece (today's)     from landing to step()
    all HOST                a host accumulator (pinned on a GPU)  from landing to its copy
    all DISK                a gradient block per tile, in the     from landing to its copy
                            swap pipeline beside MASTER and the
                            optimizer states
    DEVICE and another      today's path (only the one bucket     from landing to step()
                            ``offload_fraction``'s cut splits)

grad_reducer calls :meth:`GradientTier.landed` once a bucket's reduced slice of this
micro-step is in its target (``BucketReducer.on_reduced``, run after the next launch); the
slice is copied out (``to_host``, the one device-to-host call site) and the target's
storage is freed. Every landing of an offloaded bucket lands fresh (``GradBucket.drained``:
materialized and copied, never added to), so the device holds a gradient slice only
between its reduction and its hand-over: at most ``max_buckets_in_flight`` reductions'
outputs and one landed reduction's slices (``in_flight_bytes``).

Exactness. The slices are stored and accumulated in ``config.gradient_dtype``, the dtype
the device path accumulates in, with the same elementwise ``copy_`` (first micro-step) and
``add_`` (later ones), so the accumulated bits are the device path's. Disk accumulation
reads the tile's block, adds, and writes it back (read-add-write) rather than keeping a
host accumulator: a host accumulator of every disk tile would hold the whole gradient
shard in host memory, which is what the disk tier is for avoiding; read-add-write holds
one tile at a time, at the price of a read and a write per tile per extra micro-step.
The step's scaling (division, clipping) is replayed on every read (reduced_gradient:
``ShardGradient.finished``), with the device's arithmetic.

A gradient block is consumed only when this step's gradient has landed in it (``landed``;
cleared after every step), and every read is checked against the checksum of its write
(swap_file), so a stale or torn block raises instead of being stepped on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..reduced_gradient import ShardGradient
from .swap_file import aligned_empty
from .swapped_tiles import GRAD, SwappedTiles
from .tiers import Tier, host_empty

if TYPE_CHECKING:
    from ..grad_reducer import GradBucket
    from .masters import OffloadedMasters


def to_host(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Device-to-host copy of a landed gradient slice, into ``out`` when given; on a CPU
    device ``values`` itself when no ``out`` is given. The one call site of the gradient
    tier's device-to-host copies (a side stream with pinned staging goes here)."""
    if out is not None:
        out.copy_(values)
        return out
    return values if values.device.type == "cpu" else values.to("cpu")


class HostSlice:
    """A bucket slice's gradient in host memory, accumulated there."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.values = host_empty(numel, dtype, device, pin)  # kept: pinned memory is dear
        self._landed = False

    @property
    def landed(self) -> bool:
        return self._landed

    def land(self, target: torch.Tensor, first: bool) -> None:
        if first:
            to_host(target, self.values)
        else:
            self.values.add_(to_host(target))
        self._landed = True

    def read(self, start: int, stop: int) -> torch.Tensor:
        _check_landed(self._landed)
        return self.values[start:stop]

    def release(self) -> None:
        self._landed = False

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


class SwappedSlice:
    """A bucket slice's gradient as one block per disk tile (``GRAD`` beside the tile's
    master and states), written as it lands and accumulated read-add-write."""

    def __init__(
        self,
        swap: SwappedTiles,
        tiles: Sequence[tuple[int, int, int]],
        dtype: torch.dtype,
    ) -> None:
        """``tiles``: (disk tile index, start in the slice, elements), in slice order."""
        self.swap = swap
        self.tiles = list(tiles)
        self.dtype = dtype
        self._landed = False

    @property
    def landed(self) -> bool:
        return self._landed

    def land(self, target: torch.Tensor, first: bool) -> None:
        for index, start, numel in self.tiles:
            part = to_host(target[start : start + numel])
            if first:
                self.swap.write(index, GRAD, part)
            else:
                total = aligned_empty(numel, self.dtype)
                self.swap.read(index, GRAD, total)
                total.add_(part)
                self.swap.write(index, GRAD, total)
            self.swap.gradient_landed[index] = True
        self._landed = True

    def read(self, start: int, stop: int) -> torch.Tensor:
        """A copy of elements [start, stop), read from the tiles' blocks."""
        _check_landed(self._landed)
        out = torch.empty(stop - start, dtype=self.dtype)
        for index, at, numel in self.tiles:
            a, b = max(start, at), min(stop, at + numel)
            if a >= b:
                continue
            block = aligned_empty(numel, self.dtype)
            self.swap.read(index, GRAD, block)
            out[a - start : b - start] = block[a - at : b - at]
        return out

    def release(self) -> None:
        self._landed = False
        for index, _, _ in self.tiles:
            self.swap.gradient_landed[index] = False


def _check_landed(landed: bool) -> None:
    if not landed:
        raise RuntimeError(
            "an offloaded gradient slice was read before this step's gradient landed in it "
            "(or after the step released it): a bug in the engine's gradient bookkeeping"
        )


class GradientTier:
    """The offloaded bucket slices of one engine's reduce-scattered gradients (module
    docstring); built where ``config.gradients_offloaded``."""

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        shards: Sequence[ShardGradient],
        masters: OffloadedMasters,
        dtype: torch.dtype,
        device: torch.device,
        pin: bool,
    ) -> None:
        """Marks the offloaded buckets ``drained`` and their pieces of ``shards`` away."""
        self.buckets = list(buckets)
        self.first = True  # the micro-step in progress is the first of the accumulation
        self.homes: dict[int, HostSlice | SwappedSlice] = {}
        self.peak_held = 0  # with track_peak: most device bytes of landed slices at once
        self.track_peak = False
        for bucket in self.buckets:
            specs = [s for s in masters.plan[bucket.group] if s.bucket == bucket.index]
            tiers = {spec.tier for spec in specs}
            home: HostSlice | SwappedSlice
            if tiers == {Tier.HOST}:
                home = HostSlice(bucket.slice_numel, dtype, device, pin)
            elif tiers == {Tier.DISK}:
                assert masters.swap is not None
                start = bucket.local_offset
                tiles = [
                    (masters.disk_index(spec), spec.start - start, spec.numel) for spec in specs
                ]
                home = SwappedSlice(masters.swap, tiles, dtype)
            else:
                continue  # on the device, or split by offload_fraction: today's path
            self.homes[bucket.position] = home
            bucket.drained = True
            shards[bucket.group].away[bucket.index] = home
        self._drained = [self.buckets[position] for position in self.homes]
        self._itemsize = dtype.itemsize
        self._largest = max((b.slice_numel for b in self._drained), default=0)

    def reduced_together(self, groups: Sequence[Sequence[int]]) -> None:
        """The buckets each reduction lands at once (``BucketReducer.groups``): the
        largest such group's offloaded slices are what a landing holds."""
        self._largest = max(
            [sum(self.buckets[p].slice_numel for p in g if p in self.homes) for g in groups],
            default=0,
        )

    def landed(self, position: int) -> None:
        """``BucketReducer.on_reduced``: bucket ``position``'s slice of this micro-step is
        in its target; copy it to its tier and free the target."""
        home = self.homes.get(position)
        if home is None:
            return
        target = self.buckets[position].target
        if self.track_peak:
            held = sum(b.target.untyped_storage().nbytes() for b in self._drained)
            self.peak_held = max(self.peak_held, held)
        home.land(target, self.first)
        target.untyped_storage().resize_(0)

    def release(self) -> None:
        """After the step (or a skipped one): no slice holds a gradient any more."""
        for home in self.homes.values():
            home.release()

    @property
    def host_bytes(self) -> int:
        """Bytes of the host accumulators (the disk tiles' blocks are in the swap files)."""
        return sum(h.nbytes for h in self.homes.values() if isinstance(h, HostSlice))

    @property
    def landed_bytes(self) -> int:
        """The most device bytes of landed slices awaiting their copy: one reduction's
        (the largest: a bucket's slice, or a coalesced group's). grad_reducer hands a
        reduction's buckets over before it waits for the next one."""
        return self._largest * self._itemsize

    def in_flight_bytes(self, max_in_flight: int) -> int:
        """The device bound of the offloaded gradients: ``max_in_flight`` reductions'
        outputs (the communicator's pooled buffers, counted in ``comm_buffers``) plus the
        landed slices of one (``landed_bytes``), each at most the largest reduction."""
        return (max_in_flight + 1) * self.landed_bytes
