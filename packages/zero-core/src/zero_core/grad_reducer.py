"""Reduce-scatter gradient buckets, in one order on every rank, overlapped with backward.

A bucket is *complete* when every parameter in it has its gradient for this micro-step;
complete buckets are launched in one canonical order (backward_overlap.LaunchOrder: by
default last bucket first, over all parameter groups; stage 3 passes its own, fetch
units in reverse registration order), so every rank issues the same sequence of
collectives whatever order its hooks fire in. Buckets some parameter got no gradient for
complete in ``finish``. With ``overlap`` off nothing is launched before ``finish``. At
most ``max_in_flight`` reduce-scatters are outstanding; each one's result (this rank's
slice of the bucket) goes to that bucket's *target*, a view of the rank's gradient shard:
reduced straight into it in the first micro-step, added into it in later ones.

Staging is pooled and not zeroed whole: the padding between parameters is zeroed when a
bucket's staging is taken, each parameter's region is written by its gradient's copy, and
a parameter with no gradient in the micro-step gets zeros just before the launch.

Constant buffers (ZeRO-R's C_B): a bucket holds at most ``chunk_numel`` elements unless a
single parameter is larger. Such an *oversized* bucket is never copied whole into a staging
buffer: its gradient stays where autograd (or stage 1's persistent bucket) put it, and it
is reduced in column pieces of w = chunk_numel / N elements per rank (at least
MIN_PIECE_NUMEL, so a tiny chunk_numel does not mean a collective per element):

    bucket (N x S):  | rank 0: S | rank 1: S | ... |
    piece [a, a+w):  rows r*S+a .. r*S+a+w of every rank's part -> send (N x w, pooled)
                     reduce_scatter(send) -> this rank's slice[a, a+w)

Each element is reduced by the same collective and the same rank order as when the bucket
goes in one piece, so the results are identical; only the staging is bounded.

Coalesced launches (``coalesce_numel``): consecutive buckets in launch order whose padded
sizes add up to at most ``coalesce_numel`` are reduced by one collective, launched when the
last of them is complete. Stage 3 keeps every bucket within one fetch unit, so a model of
many small modules otherwise pays a collective's fixed cost (under qgZ two all-to-alls
and four codec passes) per module. The group's send buffer puts each rank's slices side by side::

    buckets (N = 2)     a: | a0 | a1 |      b: | b0 | b1 |      (a0: rank 0's slice of a)
    send (N x C)        | a0 b0 | a1 b1 |   C = |a0| + |b0|
    reduce_scatter      rank r gets | a_r b_r |  -> a's target, b's target

Every element keeps its destination rank and its place in a block-aligned slice, so an
exact reduction gives the same bits, and so does qgZ (its blocks start at multiples of
BLOCK within a rank's chunk, and every slice is a multiple of BLOCK long).

Several micro-batch slots per rank (``slot_rows``, zero_core.slot_rows): the reduction is
the SlotRows, which holds every slot's inputs but the last's; while it holds, nothing
lands in the targets and ``on_reduced`` is not called (the last slot reduces all rows).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from zero_comm import Communicator

from .backward_overlap import LaunchOrder
from .buckets import Bucket
from .coalescing import coalesced_groups
from .flat_layout import Range
from .group_layout import piece_numel
from .param_table import ParamSlot
from .reduced_gradient import materialize
from .slot_rows import SlotRows


@dataclass(eq=False)
class GradBucket(Bucket):
    """A gradient bucket: its slots (each one's ``flat`` is its place in the bucket), where
    its reduced slice goes, stage 1's full gradient buffer, and the reducer's state of it
    in this micro-step."""

    # slice_numel elements: this rank's accumulated gradient slice (storage may come only
    # with the first reduced slice of a step: reduced_gradient.materialize)
    target: torch.Tensor
    full_buffer: torch.Tensor | None = None  # stage 1: the full-gradient bucket (p.grad views)
    # Offloaded (offload.gradient_tier): on_reduced copies the slice out and frees the
    # target after every micro-step, so every landing materializes and copies, never adds.
    drained: bool = False
    # The elements no parameter slot covers (alignment padding, and any parameter the
    # table does not hold): zeroed when the staging is taken. A slot's own region is
    # written by its gradient's copy, or zeroed if it has none, so the staging is never
    # zeroed whole.
    padding: list[Range] = field(init=False)
    # Run-time, from the first gradient to the last reduction of a micro-step:
    staging: torch.Tensor | None = None  # pooled padded_numel elements (stage 1: full_buffer)
    held: torch.Tensor | None = None  # oversized: its one parameter's gradient, reduced from here
    pieces_left: int = 0  # its reductions in flight

    def __post_init__(self) -> None:
        self.padding = _uncovered(self.padded_numel, [slot.flat for slot in self.slots])


class Pending(Protocol):
    """A launched reduction: zero_comm's Handle, or qgZ's QuantizedHandle."""

    def wait(self) -> None: ...


class ScatterReduction(Protocol):
    """What reduces a bucket: a Communicator, zero_comm.hierarchy.HybridGroups (the shard
    group's reduce-scatter, then across the replicas), or zeropp's qgZ reduction."""

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True], label: str
    ) -> Pending: ...


@dataclass
class Launched:
    """A reduction in flight: its handle; per bucket it reduces, where that bucket's slice
    lies in ``out`` and which range of the bucket's target it fills; ``out`` (None: the
    slice lands in the target itself) and the pooled ``send`` buffer (None: the staging)."""

    handle: Pending
    members: list[tuple[int, Range, Range]]
    out: torch.Tensor | None
    send: torch.Tensor | None


class BucketReducer:
    """Collects gradients into buckets and reduce-scatters them in canonical order."""

    def __init__(
        self,
        comm: Communicator,
        buckets: list[GradBucket],
        dtype: torch.dtype,
        max_in_flight: int,
        launch_order: list[int] | None = None,
        labels: list[str] | None = None,
        chunk_numel: int | None = None,
        *,
        overlap: bool = True,
        remedy: str = "use checkpoint(..., use_reentrant=False)",
        reduction: ScatterReduction | None = None,
        coalesce_numel: int = 0,
        slot_rows: SlotRows | None = None,
    ) -> None:
        """``launch_order``: bucket indices in the order their reduce-scatters are issued
        (default: last bucket first); ``labels``: each bucket's label for the communicator's
        consistency check; ``chunk_numel``: the most elements one collective stages (buckets
        larger than this are reduced in pieces; None: never); ``overlap``: launch complete
        buckets during backward (False: all in ``finish``); ``remedy``: the advice of the
        error a second gradient after its bucket's launch raises; ``reduction``: what
        reduces a bucket (default ``comm``, whose ranks hold the slices);
        ``coalesce_numel``: consecutive buckets up to this many elements in all (and at
        most ``chunk_numel``) are reduced by one collective (module docstring; 0: each by
        itself); ``slot_rows``: several micro-batch slots per rank (module docstring; not
        with ``reduction``)."""
        self.comm = comm
        if slot_rows is not None and reduction is not None:
            raise ValueError("slot_rows and another reduction cannot be combined")
        self.slot_rows = slot_rows
        self.reduction: ScatterReduction = (
            slot_rows if slot_rows is not None else comm if reduction is None else reduction
        )
        self.chunk_numel = chunk_numel
        self.overlap = overlap
        members = [list(bucket.slots) for bucket in buckets]
        self.order = LaunchOrder(members, comm.rank, remedy, launch_order)
        self.labels = labels or [""] * len(buckets)
        self.buckets = buckets
        self.dtype = dtype
        self._empty = torch.zeros(0, dtype=dtype, device=comm.device)  # a bucket with no gradient
        self.max_in_flight = max_in_flight
        # By slot index (param_table): the bucket of every parameter.
        self._bucket_of: dict[int, int] = {
            member.index: index for index, bucket in enumerate(buckets) for member in bucket.slots
        }
        self._in_flight: deque[Launched] = deque()
        # Per bucket, the group it is reduced with (itself alone unless coalesced).
        self._group: list[list[int]] = [[index] for index in range(len(buckets))]
        if chunk_numel is not None:  # a group's staging stays within the buffers' bound
            coalesce_numel = min(coalesce_numel, chunk_numel)
        if coalesce_numel > 0:
            alone = [
                bucket.full_buffer is not None or self._oversized(index)
                for index, bucket in enumerate(buckets)
            ]
            numels = [bucket.padded_numel for bucket in buckets]
            for group in coalesced_groups(self.order.order, numels, alone, coalesce_numel):
                for index in group:
                    self._group[index] = group
        self._first = True
        self._tag = ""
        # Called with a bucket's index once its slice of this micro-step is in its target
        # (optimizer_in_backward steps and frees it there); run by _hand_over, after the
        # launch that needed the bucket's room, so the link works while the callback does.
        self.on_reduced: Callable[[int], None] | None = None
        self._reduced: list[int] = []  # the buckets whose callbacks are due

    @property
    def groups(self) -> list[list[int]]:
        """The buckets reduced by one collective each, in launch order."""
        return [self._group[index] for index in self.order.order if self._group[index][0] == index]

    def begin(self, first_micro_step: bool, tag: str = "") -> None:
        """Start a micro-step; ``tag`` is appended to every label (the micro-step)."""
        self._first = first_micro_step
        self._tag = tag
        self._reduced = []  # a backward that raised may have left some due
        self.order.begin()

    def _stage(self, index: int) -> torch.Tensor:
        bucket = self.buckets[index]
        staging = bucket.staging
        if staging is None:
            if bucket.full_buffer is not None:
                staging = bucket.full_buffer
            else:
                staging = self.comm.buffers.take(bucket.padded_numel, self.dtype)
                for gap in bucket.padding:
                    staging[gap.start : gap.stop].zero_()
            bucket.staging = staging
        return staging

    def grad_ready(self, member: ParamSlot) -> None:
        """Hook: ``member``'s ``.grad`` holds this micro-step's gradient; move it into its
        bucket."""
        index, flat, param = self._bucket_of[member.index], member.flat, member.param
        again = not self.order.arrive(member)  # raises if its bucket was launched
        if param.grad is not None and self._oversized(index):
            bucket = self.buckets[index]
            if again and bucket.held is not None:
                if bucket.held.dtype != self.dtype:  # the sum rounds in the reduce dtype
                    bucket.held = bucket.held.to(self.dtype)
                bucket.held.add_(param.grad.reshape(-1))
            else:
                bucket.held = param.grad.reshape(-1)  # reduced from here, in pieces
            param.grad = None
        elif param.grad is not None:
            region = self._stage(index)[flat.start : flat.stop]
            if again:
                region.add_(param.grad.reshape(-1))
            else:
                region.copy_(param.grad.reshape(-1))
            param.grad = None
        elif not again and not self._oversized(index):
            self._stage(index)[flat.start : flat.stop].zero_()  # arrived without a gradient
        if self.overlap:
            self._launch_ready()

    def mark_ready(self, member: ParamSlot, land: Callable[[bool], None] | None = None) -> None:
        """Stage 1: the gradient is already in place in the persistent bucket (autograd
        accumulated it into the ``p.grad`` view; a second one adds there too, so it is
        an error only once the bucket was launched). ``land``: a bucket wider than the
        gradient puts it in place here, told whether it is a second one (called after the
        launch check, before any launch)."""
        again = not self.order.arrive(member)
        if land is not None:
            land(again)
        if self.overlap:
            self._launch_ready()

    def has_gradient(self, member: ParamSlot) -> bool:
        """Whether ``member``'s gradient arrived in this micro-step."""
        return self.order.has_arrived(member)

    def _launch_ready(self) -> None:
        for index in self.order.take_ready():
            group = self._group[index]
            if len(group) == 1:
                self._launch(index)
            elif index == group[-1]:  # the others were taken before it, in order
                self._launch_group(group)
        self._hand_over()

    def _hand_over(self) -> None:
        """Run ``on_reduced`` for the buckets that finished last, if it has not run yet
        for them.

        Deferred from ``_finish_oldest``, which finishes a bucket to make room for a launch:
        run there, the callback (a bucket's optimizer step) kept the next reduce-scatter
        from starting until it returned, so the link idled while the CPU stepped. Now it
        runs after the launches (``_launch_ready``), or at the start of the next
        ``_finish_oldest``, before its wait, so that at most one reduced slice is live,
        as before (the buckets of one coalesced reduction count as one)::

            before  finish b3 | step b3 | launch b1 |          ...
            now     finish b3 | launch b1 | step b3 |          ... (b1, b2 on the wire)
        """
        due, self._reduced = self._reduced, []
        if self.on_reduced is not None:
            for index in due:
                self.on_reduced(index)

    def _oversized(self, index: int) -> bool:
        if self.chunk_numel is None:
            return False
        bucket = self.buckets[index]
        if bucket.full_buffer is None and len(bucket.slots) > 1:
            # Several parameters fit bucket_numel by construction; only the alignment
            # padding can take the bucket past it. Such a bucket goes whole: the piecewise
            # path reduces from one parameter's own .grad, which would drop the others.
            return False
        return self._width(bucket) < bucket.slice_numel

    def _width(self, bucket: GradBucket) -> int:
        assert self.chunk_numel is not None
        return piece_numel(bucket.padded_numel, self.chunk_numel, self.comm.world_size)

    def _launch(self, index: int) -> None:
        if self._oversized(index):
            self._launch_in_pieces(index)
            return
        bucket = self.buckets[index]
        self._make_room()
        staging = self._staged_for_launch(index)
        # The first micro-step's slice is reduced straight into the target, which it would
        # only be copied into. Not for stage 1's persistent bucket (the input, which holds
        # the target: a collective must not write where it reads), nor where each slice is
        # stepped and freed as it lands (on_reduced): there a slice held from launch would
        # make max_in_flight slices of the shard live at once instead of one.
        direct = self._first and bucket.full_buffer is None and self.on_reduced is None
        if direct:
            materialize(bucket.target)
        out = bucket.target if direct else self.comm.buffers.take(bucket.slice_numel, self.dtype)
        handle = self.reduction.reduce_scatter(
            out, staging, async_op=True, label=self.labels[index] + self._tag
        )
        bucket.pieces_left = 1
        whole = Range(0, bucket.slice_numel)
        members = [(index, whole, whole)]
        self._in_flight.append(Launched(handle, members, None if direct else out, None))

    def _staged_for_launch(self, index: int) -> torch.Tensor:
        """The bucket's staging, with zeros for the parameters that got no gradient."""
        staging = self._stage(index)
        for member in self.buckets[index].slots:
            if not self.order.has_arrived(member):  # no gradient this micro-step: zeros
                staging[member.flat.start : member.flat.stop].zero_()
        return staging

    def _launch_group(self, group: list[int]) -> None:
        """Reduce the buckets of ``group`` by one collective (module docstring): their
        stagings go side by side, rank by rank, into one send buffer and back to the pool."""
        self._make_room()
        n = self.comm.world_size
        total = sum(self.buckets[index].slice_numel for index in group)
        send = self.comm.buffers.take(n * total, self.dtype)
        columns = send.view(n, total)
        members, at = [], 0
        for index in group:
            bucket = self.buckets[index]
            width = bucket.slice_numel
            staging = self._staged_for_launch(index)
            columns[:, at : at + width].copy_(staging.view(n, width))
            self.comm.buffers.give_back(staging)
            bucket.staging = None
            bucket.pieces_left = 1
            members.append((index, Range(at, at + width), Range(0, width)))
            at += width
        out = self.comm.buffers.take(total, self.dtype)
        label = " + ".join(self.labels[index] for index in group) + self._tag
        handle = self.reduction.reduce_scatter(out, send, async_op=True, label=label)
        self._in_flight.append(Launched(handle, members, out, send))

    def _launch_in_pieces(self, index: int) -> None:
        """Reduce-scatter an oversized bucket in pieces of ``chunk_numel // N`` columns."""
        assert self.chunk_numel is not None
        bucket, n = self.buckets[index], self.comm.world_size
        if bucket.full_buffer is not None:  # stage 1: the whole bucket, padding included
            source, offset = bucket.full_buffer, 0
        else:
            source = bucket.held if bucket.held is not None else self._empty
            offset = bucket.slots[0].flat.start  # an oversized bucket holds one parameter
        width = self._width(bucket)
        starts = range(0, bucket.slice_numel, width)
        bucket.pieces_left = len(starts)
        for a in starts:
            piece = Range(a, min(a + width, bucket.slice_numel))
            self._make_room()
            send = self.comm.buffers.take(n * piece.size, self.dtype)
            for r, row in enumerate(send.view(n, piece.size)):
                _copy_bucket_range(row, source, offset, r * bucket.slice_numel + piece.start)
            out = self.comm.buffers.take(piece.size, self.dtype)
            label = f"{self.labels[index]}{self._tag} [{piece.start}:{piece.stop}]"
            handle = self.reduction.reduce_scatter(out, send, async_op=True, label=label)
            self._in_flight.append(Launched(handle, [(index, piece.shift(a), piece)], out, send))

    def _make_room(self) -> None:
        """Before a launch: finish the oldest until fewer than ``max_in_flight`` are out
        (their buffers go back to the pool before the next ones are taken)."""
        while len(self._in_flight) >= self.max_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        self._hand_over()
        launched = self._in_flight.popleft()
        launched.handle.wait()
        holding = self.slot_rows is not None and self.slot_rows.holding
        for index, within, piece in launched.members:
            bucket = self.buckets[index]
            if launched.out is not None and not holding:
                fresh = self._first or bucket.drained  # drained: emptied after each landing
                if fresh:  # a ShardGradient piece has storage from its first slice
                    materialize(bucket.target)
                target = bucket.target[piece.start : piece.stop]
                source = launched.out[within.start : within.stop]
                if fresh:
                    target.copy_(source)
                else:
                    target.add_(source)
            bucket.pieces_left -= 1
            if bucket.pieces_left:
                continue
            bucket.held = None
            if bucket.staging is not None and bucket.full_buffer is None:
                self.comm.buffers.give_back(bucket.staging)
            bucket.staging = None
            if self.on_reduced is not None and not holding:
                self._reduced.append(index)
        for buffer in (launched.out, launched.send):
            if buffer is not None:
                self.comm.buffers.give_back(buffer)

    def finish(self) -> None:
        """After backward: complete every bucket (missing gradients are zeros), launch the
        rest in canonical order, and wait for all of them."""
        self.order.complete_all()
        self._launch_ready()
        while self._in_flight:
            self._finish_oldest()
        self._hand_over()


def _uncovered(numel: int, covered: list[Range]) -> list[Range]:
    """The ranges of [0, numel) that none of ``covered`` (ranges within it) holds."""
    gaps, position = [], 0
    for r in sorted(covered, key=lambda r: r.start):
        if r.start > position:
            gaps.append(Range(position, r.start))
        position = max(position, r.stop)
    if position < numel:
        gaps.append(Range(position, numel))
    return gaps


def _copy_bucket_range(row: torch.Tensor, source: torch.Tensor, offset: int, start: int) -> None:
    """``row`` = bucket elements [start, start + row.numel()), where ``source`` holds bucket
    elements [offset, offset + source.numel()) and every other element is zero."""
    lo = max(start, offset)
    hi = min(start + row.numel(), offset + source.numel())
    if hi <= lo:
        row.zero_()
        return
    row[: lo - start].zero_()
    row[lo - start : hi - start].copy_(source[lo - offset : hi - offset])
    row[hi - start :].zero_()
