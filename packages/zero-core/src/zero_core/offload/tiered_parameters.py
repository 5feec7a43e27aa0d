"""Stage 3's compute shards in their tier (``offload_params``): on the device, in host
memory, or in swap files; what the gatherer all-gathers from.

Per group, this rank's shard is its bucket slices end to end (compute dtype):

    tier     holds the shard as                 a gather takes bucket k's slice as
    DEVICE   one device tensor per group        a view (no copy)
    HOST     one host tensor per group          a copy into a pooled device buffer
    DISK     one swap file per bucket slice     a read into an aligned host buffer
             offload_dir/zero-swap-rank{r}/params.g{g}.b{k}.{first parameter}.swap
                                                (then copied up on a GPU); the gatherer
                                                asks for the next units' slices ahead
                                                (``read_ahead``): read on I/O threads

Writes (initial values, then the updated masters after each step) arrive piece by piece;
a swapped bucket slice is written out when all of its elements have arrived
(partial_blocks), so at most the slices being filled are held, not the shard. On the
device tier, an update from a host master tile goes up on a side stream (copy_streams);
``finish_writes`` and ``take`` make the current stream wait for it, through an event.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zero_comm import Communicator
from zero_comm.profiler_ranges import profiler_range

from ..buckets import build_buckets
from ..group_layout import GroupLayout
from .copy_streams import CopyStream, CopyTicket
from .partial_blocks import PartialBlocks
from .swap_file import SwapFile, aligned_empty
from .tiers import Tier, host_empty

BLOCK = "shard"


class ParameterShards:
    """This rank's compute shard of every group, in one tier; see the module docstring."""

    def __init__(
        self,
        layouts: list[GroupLayout],
        rank: int,
        dtype: torch.dtype,
        comm: Communicator,
        tier: Tier,
        *,
        folder: Path | None = None,
        labels: dict[tuple[int, int], str] | None = None,
        pin: bool = True,
        io_threads: int = 2,
    ) -> None:
        self.layouts = layouts
        self.buckets = build_buckets(layouts, None)
        self.dtype = dtype
        self.comm = comm
        self.tier = tier
        self.shards: list[torch.Tensor] = []
        self._files: dict[tuple[int, int], SwapFile] = {}
        self.bytes_read = 0
        self._pending: dict[tuple[int, int], tuple[Future[None], torch.Tensor]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.pin = pin
        self._copies: CopyStream | None = None  # host masters' updates up (device tier)
        self._last_upload: CopyTicket | None = None
        if tier is Tier.DISK:
            self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="zero-params")
            assert folder is not None and labels is not None
            folder.mkdir(parents=True, exist_ok=True)
            itemsize = dtype.itemsize
            for g, layout in enumerate(layouts):
                for k, bucket in enumerate(layout.buckets):
                    name = f"params.g{g}.b{k}.{labels[(g, k)]}.swap"
                    self._files[(g, k)] = SwapFile(folder / name, bucket.slice_numel * itemsize)
            numels: dict[Hashable, int] = {
                (g, k): b.slice_numel
                for g, lay in enumerate(layouts)
                for k, b in enumerate(lay.buckets)
            }
            expected: dict[Hashable, int] = dict.fromkeys(numels, 0)
            for g, layout in enumerate(layouts):
                for piece in layout.local_pieces(rank):
                    expected[(g, piece.bucket)] += piece.local_range.size
            self._filling = PartialBlocks(numels, expected, dtype, self._write_block)
            self._updates = PartialBlocks(numels, dict(numels), dtype, self._write_block)
        else:
            for layout in layouts:
                if tier is Tier.HOST:
                    shard = host_empty(layout.shard_numel, dtype, comm.device, pin).zero_()
                else:
                    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=comm.device)
                self.shards.append(shard)

    # ------------------------------------------------------------- writes
    def fill(self, group: int, start: int, values: torch.Tensor) -> None:
        """Initial values: elements [start, start + len(values)) of ``group``'s shard."""
        if self.tier is Tier.DISK:
            self._route(self._filling, group, start, values)
        else:
            self.shards[group][start : start + values.numel()] = values

    def finish_fill(self) -> None:
        if self.tier is Tier.DISK:
            self._filling.finish()

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        """Updated float32 master values of [start, start + len(values)), cast."""
        if self.tier is Tier.DISK:
            self._route(self._updates, group, start, values)
            return
        target = self.shards[group][start : start + values.numel()]
        if target.data_ptr() == values.data_ptr():
            return  # the master is this shard (aliased)
        if self.tier is Tier.DEVICE and values.device.type == "cpu":
            # A host master tile: up on the side stream while the next tile is stepped
            # (inline where all is on CPU); a gather's take waits for it on the device.
            if self._copies is None:
                self._copies = CopyStream(self.comm.device, pin=self.pin)
            self._last_upload = self._copies.to_device(values, target)
        else:
            target.copy_(values)

    def finish_writes(self) -> None:
        if self.tier is Tier.DISK:
            self._updates.finish()
        self._uploaded()

    def _uploaded(self) -> None:
        """The current stream waits for the uploads so far (an event, no host wait)."""
        if self._last_upload is not None:
            self._last_upload.wait_stream()
            self._last_upload = None

    def _route(self, blocks: PartialBlocks, group: int, start: int, values: torch.Tensor) -> None:
        """Split [start, start + n) of the group's shard over its bucket slices."""
        for bucket, overlap in self.buckets.groups[group].overlapping(
            start, start + values.numel()
        ):
            part = values[overlap.start - start :][: overlap.size]
            blocks.write((group, bucket.index), overlap.start - bucket.local_offset, part)

    def _write_block(self, key: Hashable, buffer: torch.Tensor) -> None:
        assert isinstance(key, tuple)
        self._files[key].write(0, buffer, BLOCK)

    # ------------------------------------------------------------- gathers
    def owned_slices(self) -> list[list[torch.Tensor]]:
        """Per group and bucket, this rank's slice (the device tier only: what an
        aliased master is)."""
        assert self.tier is Tier.DEVICE
        return [
            [shard[b.local_range.start : b.local_range.stop] for b in group]
            for group, shard in zip(self.buckets.groups, self.shards, strict=True)
        ]

    def take(self, group: int, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s slice of ``group``'s shard on the device, to all-gather
        from; hand it back with :meth:`give_back` once the gather is waited for."""
        local = self.buckets.at(group, bucket).local_range
        if self.tier is Tier.DEVICE:
            self._uploaded()
            return self.shards[group][local.start : local.stop]
        if self.tier is Tier.HOST:
            staged = self.comm.buffers.take(local.size, self.dtype)
            staged.copy_(self.shards[group][local.start : local.stop])
            return staged
        future, host = self._pending.pop((group, bucket), (None, None))
        if future is None or host is None:
            host = self._host_buffer(local.size)
            self._files[(group, bucket)].read(0, host, BLOCK)
        else:
            with profiler_range("swap.read.wait"):
                future.result()
        self.bytes_read += host.numel() * host.element_size()
        if self.comm.device.type == "cpu":
            return host
        staged = self.comm.buffers.take(host.numel(), self.dtype)  # a GPU: copy up
        staged.copy_(host)
        self._give_back_host(host)
        return staged

    def read_ahead(self, group: int, bucket: int) -> None:
        """Start reading bucket ``bucket``'s slice of ``group`` from disk on an I/O thread
        (the disk tier only; a no-op if already reading): ``take`` then waits for it."""
        if self._pool is None or (group, bucket) in self._pending:
            return
        host = self._host_buffer(self.buckets.at(group, bucket).slice_numel)
        future = self._pool.submit(self._files[(group, bucket)].read, 0, host, BLOCK)
        self._pending[(group, bucket)] = (future, host)

    def give_back(self, tensor: torch.Tensor) -> None:
        if self.tier is Tier.DEVICE:
            return
        if self.tier is Tier.DISK and tensor.device.type == "cpu":
            self._give_back_host(tensor)
        else:
            self.comm.buffers.give_back(tensor)

    def _host_buffer(self, numel: int) -> torch.Tensor:
        # Fresh each time, not pooled: a pool would keep the high-water mark of the reads
        # ahead (most of the shard) in memory for good.
        return aligned_empty(numel, self.dtype)

    def _give_back_host(self, tensor: torch.Tensor) -> None:
        return None  # dropped: its memory goes back with the last reference

    # -------------------------------------------------------------- report
    def device_tensors(self) -> list[torch.Tensor]:
        return self.shards if self.tier is Tier.DEVICE else []

    @property
    def host_bytes(self) -> int:
        if self.tier is Tier.HOST:
            return sum(s.numel() * s.element_size() for s in self.shards)
        if self.tier is Tier.DISK:
            held = [b for _, b in self._pending.values()]
            buffers = sum(b.numel() * b.element_size() for b in held)
            return self._filling.open_bytes + self._updates.open_bytes + buffers
        return 0

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self._files.values())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for swap in self._files.values():
            swap.remove()
