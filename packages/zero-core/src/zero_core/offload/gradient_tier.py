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
slice is copied out (``to_host``, the one device-to-host call site: a side stream with
pinned staging, copy_streams; inline on a CPU device) and the target's storage is freed;
the copies into host slices land while backward goes on and are waited for at its end.
Every landing of an offloaded bucket lands fresh (``GradBucket.drained``: materialized and
copied, never added to), so the device holds a gradient slice only between its reduction
and its hand-over: at most ``max_buckets_in_flight`` reductions'
outputs and one landed reduction's slices (``in_flight_bytes``).

A disk slice's tiles are copied out of the device as it lands and written (or read,
added to and written back) on the swap pipeline's I/O threads while backward goes on, at
most ``WRITES_IN_FLIGHT`` tiles at once; every backward ends by waiting for them.

Exactness. The slices are stored and accumulated in ``config.gradient_dtype``, the dtype
the device path accumulates in, with the same elementwise ``copy_`` (first micro-step) and
``add_`` (later ones), so the accumulated bits are the device path's. Disk accumulation
reads the tile's block, adds, and writes it back (read-add-write) rather than keeping a
host accumulator: a host accumulator of every disk tile would hold the whole gradient
shard in host memory, which is what the disk tier is for avoiding; read-add-write holds
one tile at a time, at the price of a read and a write per tile per extra micro-step.
The step's scaling (division, clipping) is replayed on every read (reduced_gradient:
``ShardGradient.finished``), with the device's arithmetic.

The boundary's finiteness check needs no read of a disk slice: each tile's write finds
whether its accumulated values are finite while they are in memory, and dividing finite
values by a denominator >= 1 (N x steps x loss scale; the loss scale is 1 unless float16
scales it up) keeps them finite, whether it divides or multiplies by the reciprocal.

A gradient block is consumed only when this step's gradient has landed in it (``landed``;
cleared after every step), and every read is checked against the checksum of its write
(swap_file), so a stale or torn block raises instead of being stepped on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..reduced_gradient import ShardGradient
from .copy_streams import CopyStream, CopyTicket
from .swap_file import aligned_empty
from .swapped_tiles import GRAD, SwappedTiles
from .tiers import Tier, host_empty

if TYPE_CHECKING:
    from ..grad_reducer import GradBucket
    from .masters import OffloadedMasters


def to_host(copies: CopyStream, values: torch.Tensor, out: torch.Tensor) -> CopyTicket:
    """Device-to-host copy of (part of) a landed gradient slice into ``out``: the one call
    site of the gradient tier's device-to-host copies. On a side stream after the work
    that produced ``values`` (copy_streams: straight into pinned ``out``, else through
    pinned staging); ``out`` holds the values once the ticket is waited for, or the
    stream drained. Inline on a CPU device (the ticket is done)."""
    return copies.to_host(values, out)


class HostSlice:
    """A bucket slice's gradient in host memory, accumulated there."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.values = host_empty(numel, dtype, device, pin)  # kept: pinned memory is dear
        self._landed = False
        self.generation = 0  # steps that released it (reduced_gradient.AwaySlice)

    @property
    def landed(self) -> bool:
        return self._landed

    def land(self, target: torch.Tensor, first: bool, copies: CopyStream, scratch: Scratch) -> None:
        """This micro-step's slice (``target``, on the device): copied in (first), or
        added, in the gradient dtype, as the device path adds it (later ones). The first
        copy lands when ``copies`` is drained (at the end of the backward)."""
        if first:
            to_host(copies, target, self.values)
        elif copies.inline:  # the device is the host: add it where it is
            self.values.add_(target)
        else:
            down = scratch.take(target.numel())
            to_host(copies, target, down).wait_host()
            self.values.add_(down)
        self._landed = True

    def read(self, start: int, stop: int) -> torch.Tensor:
        _check_landed(self._landed)
        return self.values[start:stop]

    def release(self) -> None:
        self._landed = False
        self.generation += 1

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


# Disk tiles' gradient writes in flight at once behind the backward, each with its pair of
# tile buffers (the landed part and the block read back to add it to).
WRITES_IN_FLIGHT = 2


class Scratch:
    """One host buffer of up to a slice's elements (pinned on a GPU), made on first use:
    where a later micro-step's host slice comes down before it is added."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.numel, self.dtype, self.device, self.pin = numel, dtype, device, pin
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = host_empty(self.numel, self.dtype, self.device, self.pin)
        return self._buffer[:numel]

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self.numel * self.dtype.itemsize


class WriteBehind:
    """The disk slices' gradient writes, run on the swap pipeline's I/O threads while the
    backward goes on: ``WRITES_IN_FLIGHT`` pairs of aligned tile buffers, each lent to one
    tile's landing at a time (aligned, so a swap write or read goes straight from them, not
    through a bounce buffer per thread). A landing copies its part out of the device into
    the oldest free pair, waiting for that pair's write when every pair is in flight;
    ``drain`` waits for them all, at the end of every backward, so the next micro-step's
    read-add-write of a tile always reads the last one's write."""

    def __init__(
        self, swap: SwappedTiles, numel: int, dtype: torch.dtype, copies: CopyStream
    ) -> None:
        self.swap = swap
        self.copies = copies
        self.numel = numel
        self.dtype = dtype
        self._free: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self._pending: deque[tuple[Future[None], tuple[torch.Tensor, torch.Tensor]]] = deque()
        self._made = 0
        self.finite: dict[int, bool] = {}  # per tile: its block's values are all finite

    def _take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._free:
            return self._free.popleft()
        if self._made < WRITES_IN_FLIGHT:
            self._made += 1
            return aligned_empty(self.numel, self.dtype), aligned_empty(self.numel, self.dtype)
        future, pair = self._pending.popleft()
        error = future.exception()  # waits
        self._free.append(pair)
        if error is not None:
            raise error
        return self._free.popleft()

    def land(self, index: int, values: torch.Tensor, first: bool) -> None:
        """Tile ``index``'s part of a landed slice (on the device): copied into a pair's
        first buffer now, written (``first``) or added to the tile's block (read, add,
        write) on an I/O thread."""
        pair = self._take()
        numel = values.numel()
        landed, total = pair[0][:numel], pair[1][:numel]
        to_host(self.copies, values, landed).wait_host()  # the I/O thread reads it next
        self._pending.append((self.swap.submit(self._write, index, landed, total, first), pair))

    def _write(self, index: int, landed: torch.Tensor, total: torch.Tensor, first: bool) -> None:
        if not first:
            self.swap.read(index, GRAD, total)
            total.add_(landed)
        block = landed if first else total
        # Whether the accumulated values are finite, found while they are in memory: at
        # the boundary this saves reading the block once more (GradientTier docstring).
        self.finite[index] = bool(torch.isfinite(block).all())
        self.swap.write(index, GRAD, block)
        self.swap.gradient_landed[index] = True

    def drain(self, *, raise_errors: bool = True) -> None:
        """Wait for every write in flight; raise the first error (a full disk names its
        folder) unless ``raise_errors`` is False (a backward that raised already: a block
        whose write failed is refused when read, swap_file)."""
        errors = []
        while self._pending:
            future, pair = self._pending.popleft()
            error = future.exception()
            self._free.append(pair)
            if error is not None:
                errors.append(error)
        if errors and raise_errors:
            raise errors[0]

    def read(self, index: int, numel: int) -> torch.Tensor:
        """Tile ``index``'s block, read into a free buffer (valid until the next landing
        or read)."""
        self.drain()
        pair = self._take()
        self._free.appendleft(pair)
        block = pair[1][:numel]
        self.swap.read(index, GRAD, block)
        return block

    @property
    def nbytes(self) -> int:
        return self._made * 2 * self.numel * self.dtype.itemsize


class SwappedSlice:
    """A bucket slice's gradient as one block per disk tile (``GRAD`` beside the tile's
    master and states), written as it lands and accumulated read-add-write, behind the
    backward (``WriteBehind``)."""

    def __init__(
        self,
        tiles: Sequence[tuple[int, int, int]],
        writes: WriteBehind,
    ) -> None:
        """``tiles``: (disk tile index, start in the slice, elements), in slice order."""
        self.tiles = list(tiles)
        self.writes = writes
        self.dtype = writes.dtype
        self._landed = False
        self.generation = 0  # steps that released it (reduced_gradient.AwaySlice)

    @property
    def landed(self) -> bool:
        return self._landed

    def land(self, target: torch.Tensor, first: bool) -> None:
        for index, start, numel in self.tiles:
            self.writes.land(index, target[start : start + numel], first)
        self._landed = True

    def finite(self) -> bool:
        """Whether every accumulated value of this step is finite (known since its last
        landing, no read needed)."""
        _check_landed(self._landed)
        return all(self.writes.finite[index] for index, _, _ in self.tiles)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """A copy of elements [start, stop), read from the tiles' blocks."""
        _check_landed(self._landed)
        out = torch.empty(stop - start, dtype=self.dtype)
        for index, at, numel in self.tiles:
            a, b = max(start, at), min(stop, at + numel)
            if a < b:
                out[a - start : b - start] = self.writes.read(index, numel)[a - at : b - at]
        return out

    def release(self) -> None:
        self._landed = False
        self.generation += 1
        for index, _, _ in self.tiles:
            self.writes.swap.gradient_landed[index] = False


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
        largest_tile = (
            max((spec.numel for spec in masters.swap.specs), default=0) if masters.swap else 0
        )
        # The tier's own side stream: the masters' is stepped from another thread with a
        # delayed update, and a CopyStream serves one thread at a time.
        self.copies = CopyStream(device, pin=pin)
        self.writes: WriteBehind | None = None
        if masters.swap is not None:
            self.writes = WriteBehind(masters.swap, largest_tile, dtype, self.copies)
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
                assert self.writes is not None
                home = SwappedSlice(tiles, self.writes)
            else:
                continue  # on the device, or split by offload_fraction: today's path
            self.homes[bucket.position] = home
            bucket.drained = True
            shards[bucket.group].away[bucket.index] = home
        self._drained = [self.buckets[position] for position in self.homes]
        self._itemsize = dtype.itemsize
        self._largest = max((b.slice_numel for b in self._drained), default=0)
        largest_host = max(
            (h.values.numel() for h in self.homes.values() if isinstance(h, HostSlice)),
            default=0,
        )
        self.scratch = Scratch(largest_host, dtype, device, pin)

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
        if isinstance(home, HostSlice):
            home.land(target, self.first, self.copies, self.scratch)
        else:
            home.land(target, self.first)
        # Freed now: a copy still reading it on the side stream keeps the memory from
        # reuse until it has run (copy_streams marks it with record_stream).
        target.untyped_storage().resize_(0)

    def release(self) -> None:
        """After the step (or a skipped one): no slice holds a gradient any more."""
        for home in self.homes.values():
            home.release()

    @property
    def host_bytes(self) -> int:
        """Bytes of the host accumulators and the disk slices' staging (the disk tiles'
        blocks are in the swap files)."""
        held = sum(h.nbytes for h in self.homes.values() if isinstance(h, HostSlice))
        held += self.scratch.nbytes + self.copies.staging_bytes
        return held + (0 if self.writes is None else self.writes.nbytes)

    def drain(self, *, raise_errors: bool = True) -> None:
        """Wait for the copies down and the disk slices' writes (``WriteBehind.drain``):
        after every backward."""
        self.copies.drain()
        if self.writes is not None:
            self.writes.drain(raise_errors=raise_errors)

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
