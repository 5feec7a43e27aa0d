"""Parameters every rank holds whole (stages 0-2): views into full bucket buffers.

Each bucket (a ReplicatedBucket) holds one full buffer in the compute dtype; each
parameter's ``.data`` is its flat range of it. Rank r owns the r-th slice of every bucket
(the whole bucket where the layout has one rank, stage 0):

    bucket k, N = 4, rank 1     | r0 | r1 | r2 | r3 |   parameters (compute dtype, full)
                                       ^^^^ rank 1's slice: its aliased master (float32)

Publishing after the optimizer step: the masters hand each updated tile over
(``take_master_values``: cast into the rank's own slice, unless the master is that
slice); with a sharded master, every bucket is all-gathered from each rank's slice (at
most ``max_buckets_in_flight`` at once; a bucket past ``bucket_numel`` in column pieces).
A bucket's all-gather is launched, asynchronously, as soon as every element of this
rank's slice of it has been handed over, so it overlaps the optimizer's step of the next
buckets when the masters step bucket by bucket (master_weights); ``publish`` launches
the rest and waits for all. A tile in host memory (offload) goes up to the device on a
side stream (offload.copy_streams), so the host steps the next tile meanwhile; a
gather, or the next forward, waits for it on the device through an event:

    optimizer     | step b0 | step b1 | step b2 |
    all-gathers             | b0 ......| b1 .....| b2 ....|   <- publish waits here

Launches follow the canonical order (group, then bucket) on every rank, whatever order
the tiles arrive in: a bucket complete before an earlier one waits for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zero_comm import Communicator, Handle

from .buckets import Bucket, BucketTable, build_buckets
from .component_contracts import ParametersAlwaysWhole
from .config.zero_config import ZeroConfig
from .group_layout import GroupLayout, piece_numel
from .init_values import become
from .offload.copy_streams import CopyStream, CopyTicket
from .param_table import ParamSlot, ParamTable

InFlight = tuple[Handle, torch.Tensor, torch.Tensor | None, torch.Tensor]


@dataclass(eq=False)
class ReplicatedBucket(Bucket):
    """A bucket of whole parameters: its full padded buffer (compute dtype; each slot's
    ``param_view`` is its flat range of it), this rank's slice of that buffer (``owned``,
    a view: what an aliased master is), and how many elements of the slice were handed
    over since the last publish (``received``; its all-gather launches at slice_numel)."""

    full_buffer: torch.Tensor
    owned: torch.Tensor
    received: int = 0


class ReplicatedParameters(ParametersAlwaysWhole):
    """Whole parameters on every rank, as views of per-bucket buffers (what they have
    nothing to do for: ParametersAlwaysWhole)."""

    def __init__(
        self,
        slots: ParamTable,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        comm: Communicator,
        config: ZeroConfig,
    ) -> None:
        self.slots = slots
        self.layouts = layouts
        self.comm = comm
        self.config = config
        self.dtype = dtype
        rank = comm.rank if any(lay.world_size > 1 for lay in layouts) else 0
        self.buckets: BucketTable[ReplicatedBucket] = build_buckets(layouts, slots).map(
            lambda bucket: self._bucket(bucket, rank)
        )
        # The buckets that are all-gathered, in launch order.
        self._order = [
            bucket
            for group in self.buckets.groups
            if group.layout.world_size > 1
            for bucket in group
        ]
        self._launched = 0  # buckets of _order launched since the last publish
        self._in_flight: deque[InFlight] = deque()
        # Host tiles' updated values go up on a side stream (offload; made on first use).
        self._copies: CopyStream | None = None
        self._last_upload: CopyTicket | None = None

    def _bucket(self, bucket: Bucket, rank: int) -> ReplicatedBucket:
        """``bucket`` with its full buffer (zeros), and its slots' parameter views of it."""
        full = torch.zeros(bucket.padded_numel, dtype=self.dtype, device=self.comm.device)
        for slot in bucket.slots:
            slot.param_view = full[slot.flat.start : slot.flat.stop].view(slot.shape)
        owned = full[bucket.owned_range(rank).start :][: bucket.slice_numel]
        return ReplicatedBucket(*bucket.base(), full_buffer=full, owned=owned)

    def owned_slices(self) -> list[list[torch.Tensor]]:
        """Per group and bucket, this rank's slice of the full buffer (what an aliased
        master is)."""
        return [[bucket.owned for bucket in group] for group in self.buckets.groups]

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Give ``slot``'s parameter its initial ``value`` (float32, whole, flat): the
        parameter becomes its view of the bucket, in the compute dtype."""
        assert slot.param_view is not None
        slot.param_view.copy_(value.view(slot.shape))
        become(slot.param, slot.param_view)

    def finish_build(self) -> None:
        return None

    def take_master_values(self, group: int, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of this rank's master of ``group``
        (float32, updated, final for this step) into its owned slices, cast to the
        compute dtype; then the all-gathers of the buckets now complete are launched."""
        buckets = self.buckets.groups[group]
        for bucket, overlap in buckets.overlapping(start, start + values.numel()):
            target = bucket.owned[overlap.shift(bucket.local_offset).start :][: overlap.size]
            source = values[overlap.start - start :][: overlap.size]
            if target.data_ptr() == source.data_ptr():
                pass  # the master is this slice (aliased)
            elif source.device.type == "cpu":  # a host tile (inline where all is on CPU)
                self._upload(source, target)
            else:
                target.copy_(source)
            if buckets.layout.world_size > 1:
                self._count(bucket, overlap.size)
        self._launch(ready_only=True)

    def _count(self, bucket: ReplicatedBucket, numel: int) -> None:
        if bucket.received + numel > bucket.slice_numel:
            raise RuntimeError(
                f"[rank {self.comm.rank}] bucket {bucket.index} of group {bucket.group} was "
                "handed more master values than its slice holds since the last publish: "
                "each element must be handed over once per publish (masters.step or "
                "masters.visit, then parameters.publish)"
            )
        bucket.received += numel

    def publish(self) -> None:
        """Every rank's owned slices (updated by ``take_master_values``) into every
        rank's full buckets; see the module docstring. Launches the all-gathers not
        launched yet (all of them when no values were handed over: aliased masters
        stepped at once), waits for every one, and starts the next count.

        full (N x S) viewed as rows:  full[r, a:b] = rank r's owned slice[a:b]
        """
        self._launch(ready_only=False)
        self._uploaded()  # world size 1: no gather waited for them
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        self._launched = 0
        for bucket in self.buckets:
            bucket.received = 0
        self._check_storage()

    def _upload(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """A host tile's values up into the device slice ``target`` on the side stream
        (cast on the host into a pinned staging slot): the host goes on to step the next
        tile while it is copied. The stream that uses ``target`` next waits for it
        (``_uploaded``); the host never does."""
        if self._copies is None:
            self._copies = CopyStream(self.comm.device, pin=self.config.offload_pin_memory)
        self._last_upload = self._copies.to_device(source, target)

    def _uploaded(self) -> None:
        """The current stream waits for the uploads so far (one event: they run in
        order on one side stream), before a gather or the next forward reads them."""
        if self._last_upload is not None:
            self._last_upload.wait_stream()
            self._last_upload = None

    def _launch(self, *, ready_only: bool) -> None:
        """Launch the all-gathers of the next buckets in launch order: those whose slice
        is complete (``ready_only``), or all that are left; at most
        ``max_buckets_in_flight`` stay in flight (the oldest is waited for first)."""
        while self._launched < len(self._order):
            bucket = self._order[self._launched]
            if ready_only and bucket.received < bucket.slice_numel:
                return
            self._uploaded()
            for launched in self._gather_bucket(bucket):
                self._in_flight.append(launched)
                if len(self._in_flight) > self.config.max_buckets_in_flight:
                    self._finish(self._in_flight.popleft())
            self._launched += 1

    def _gather_bucket(self, bucket: ReplicatedBucket) -> Iterator[InFlight]:
        """Launch the all-gathers of one bucket: whole, or in pieces of ``piece_numel``
        columns gathered into a pooled buffer when it is past ``bucket_numel``."""
        full, master = bucket.full_buffer, bucket.owned
        n, size = self.comm.world_size, master.numel()
        width = piece_numel(bucket.padded_numel, self.config.bucket_numel, n)
        if bucket.layout.uneven:  # uneven shards move a bucket whole (uneven_shards)
            width = max(size, 1)
        oversized = width < size
        for a in range(0, size, width):
            b = min(a + width, size)
            # Staged apart: the master may be ``full``'s own slice, and the communicator
            # does not promise an input that aliases the output.
            mine = self.comm.buffers.take(b - a, self.dtype)
            mine.copy_(master[a:b])
            if oversized:
                gathered = self.comm.buffers.take(n * (b - a), self.dtype)
                handle = self.comm.all_gather(gathered, mine, async_op=True)
                yield handle, mine, gathered, full.view(n, size)[:, a:b]
            else:
                yield self.comm.all_gather(full, mine, async_op=True), mine, None, full

    def _finish(self, launched: InFlight) -> None:
        handle, staged, gathered, destination = launched
        handle.wait()
        if gathered is not None:
            destination.copy_(gathered.view(destination.shape))
            self.comm.buffers.give_back(gathered)
        self.comm.buffers.give_back(staged)

    def _check_storage(self) -> None:
        """The parameters must still live in the buckets the updates are written into."""
        for slot in self.slots:
            assert slot.param_view is not None
            if slot.param.data_ptr() != slot.param_view.data_ptr():
                raise RuntimeError(
                    f"[rank {self.comm.rank}] parameter {slot.name} no longer uses the "
                    "engine's storage: its .data was replaced after initialize (for example "
                    "by module.to() or .half()), so updates would not reach it. Change the "
                    "model before zero_core.initialize"
                )

    def full_bucket(self, group: int, bucket: int) -> torch.Tensor:
        """The full buffer of bucket ``bucket`` of ``group`` (what masters.write_back
        reads)."""
        return self.buckets.at(group, bucket).full_buffer

    def report_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """What the memory report counts as parameters: every parameter, whole."""
        return list(module.parameters())
