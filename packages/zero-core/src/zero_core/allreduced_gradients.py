"""Gradients replicated on every rank (stage 0), all-reduced during backward.

As DDP does with ``gradient_as_bucket_view``, each group's gradients live in one flat
buffer (the group's layout: one bucket, no gaps): a parameter's gradient is copied in as
autograd hands it over, and from then until the step ``.grad`` is a view of it (None
outside, drop_grad_views):

    group g   | grad p0 | grad p1 | grad p2 |   p.grad = views; all-reduced in chunks of
              |  chunk 0     | chunk 1  |c2|   at most bucket_numel elements

As DDP's reducer does, a chunk's all-reduce is launched (asynchronously) as soon as every
parameter overlapping it has its gradient, in one canonical order on every rank (last
chunk first, over all groups: backward_overlap), at most ``max_buckets_in_flight`` at
once; after backward the rest are launched (parameters without a gradient are zeros) and
all are waited for. Each element goes through the same all-reduce of the same chunk
whenever it is launched, so the bits do not depend on the overlap (``overlap_comm=False``
launches everything after backward).

With accumulation, the reduced gradients are summed into a second buffer of the same size.

Both buffers are in ``config.gradient_dtype``. With a reduce dtype wider than the compute
dtype (``reduce_dtype=float32`` with bfloat16 compute) a float32 buffer cannot be a
parameter's ``.grad``: each gradient is cast into its place as it lands and ``.grad``
is dropped (``land_in_buffer``), so between backward and the step ``.grad`` is None, as
at stages 2 and 3, and the hooks run with ``overlap_comm=False`` too (they then cast, and
launch nothing until after backward), so a second gradient in one backward is added in
float32 whether or not the reductions overlap backward.

With several micro-batch slots per rank (``slot_rows``: zero_core.slot_rows) every
slot but the last holds its chunks instead of reducing them, and the last all-reduces
the rows of all of them; only then is the micro-step's result accumulated.
"""

from __future__ import annotations

from collections import deque

import torch

from zero_comm import Communicator, Handle

from .backward_overlap import LaunchOrder, register_gradient_hooks
from .config.zero_config import ZeroConfig
from .grad_norm import param_row_sums
from .group_layout import MIN_PIECE_NUMEL, GroupLayout
from .memory.report import tensor_bytes
from .param_table import ParamSlot, ParamTable
from .reduced_gradient import GroupGradient
from .slot_rows import SlotRows


class AllReducedGradients:
    """Whole gradients on every rank, as views of one flat buffer per group."""

    def __init__(
        self,
        slots: ParamTable,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        comm: Communicator,
        config: ZeroConfig,
        slot_rows: SlotRows | None = None,
    ) -> None:
        self.slots = slots
        self.comm = comm
        self.config = config
        self.slot_rows = slot_rows  # several micro-batch slots per rank, or None
        if slot_rows is not None and comm.rank == 0:
            slot_rows.in_place = True  # rank 0 adds its slots into the flat buffers
        # From backward to step p.grad views the engine's buffer, unless the buffer is in a
        # wider dtype than the parameters (reduce_dtype): then gradients are cast into it.
        self.grads_are_views = dtype == config.param_dtype
        self.flats = [
            torch.zeros(layout.padded_numel, dtype=dtype, device=comm.device) for layout in layouts
        ]
        for slot in slots:
            flat = self.flats[slot.group]
            slot.grad_view = flat[slot.flat.start : slot.flat.stop]
        accumulate = config.gradient_accumulation_steps > 1
        self._accumulated = [torch.zeros_like(g) for g in self.flats] if accumulate else None
        self._label = ""
        # Every group's chunks, (group, start, stop), and the parameters overlapping each.
        self.chunks = [
            (g, start, stop)
            for g, group in enumerate(slots.by_group)
            for start, stop in self._chunks(group)
        ]
        members = [
            [
                s
                for s in slots.by_group[g]
                if s.numel and start < s.flat.stop and s.flat.start < stop
            ]
            for g, start, stop in self.chunks
        ]
        self.order = LaunchOrder(
            members, comm.rank, "use checkpoint(..., use_reentrant=False), or overlap_comm=False"
        )
        self._in_flight: deque[Handle] = deque()
        self._accepting = False  # inside engine.backward: hooks take gradients over
        self._hooks = (
            register_gradient_hooks(self, slots, AllReducedGradients._on_gradient)
            if self._hooked
            else []
        )

    @property
    def _hooked(self) -> bool:
        """Whether hooks take gradients over as they land: to launch chunks during
        backward, or to cast them into a wider buffer (module docstring)."""
        return self.config.overlap_comm or not self.grads_are_views

    def before_backward(self, first_micro_step: bool, label: str) -> None:
        self._label = label
        self.order.begin()
        self._accepting = self._hooked

    def _on_gradient(self, slot: ParamSlot) -> None:
        """Hook: ``slot``'s gradient is in its view (restored there if the user replaced
        ``.grad``), or cast into its place in the wider buffer; launch the chunks this
        completes, in canonical order."""
        if not self._accepting:
            return
        adding = self.slot_rows is not None and self.slot_rows.adding
        if self.grads_are_views:
            restore_grad_view(slot, add=adding)
            again = not self.order.arrive(slot)  # raises if a chunk of it was launched already
        else:
            again = not self.order.arrive(slot)  # raises before anything is written
            land_in_buffer(slot, again or adding)
        if again and adding:
            assert self.slot_rows is not None
            self.slot_rows.refuse_second_gradient(slot.name)
        if self.config.overlap_comm:
            self._launch_ready()

    def _launch_ready(self) -> None:
        for index in self.order.take_ready():
            group, start, stop = self.chunks[index]
            chunk = self.flats[group][start:stop]
            while len(self._in_flight) >= self.config.max_buckets_in_flight:
                self._in_flight.popleft().wait()
            label = "gradients" + self._label
            if self.slot_rows is not None:
                self._in_flight.append(self.slot_rows.all_reduce(chunk, label=label))
            else:
                self._in_flight.append(self.comm.all_reduce(chunk, async_op=True, label=label))

    def after_backward(self, first_micro_step: bool) -> None:
        """All-reduce what backward left (parameters without a gradient are zeros), wait
        for every chunk, and add this micro-step's gradients into the accumulation."""
        adding = self.slot_rows is not None and self.slot_rows.adding
        for slot in self.slots:
            if not self.order.has_arrived(slot):
                if self.grads_are_views:
                    restore_grad_view(slot, add=adding)
                else:
                    land_in_buffer(slot, again=adding)
        self.order.complete_all()
        self._launch_ready()
        while self._in_flight:
            self._in_flight.popleft().wait()
        if self.slot_rows is not None and self.slot_rows.holding:
            return  # held, not reduced: the micro-step's last slot reduces every slot
        if self._accumulated is not None:
            for total, flat in zip(self._accumulated, self.flats, strict=True):
                if first_micro_step:
                    total.copy_(flat)
                else:
                    total.add_(flat)
                flat.zero_()

    def end_backward(self) -> None:
        self._accepting = False

    def _chunks(self, group: list[ParamSlot]) -> list[tuple[int, int]]:
        """Ranges of at most ``bucket_numel`` elements, ending at parameter boundaries
        where whole parameters fit; a larger parameter is cut into ``bucket_numel`` pieces
        (the communicator stages each range: C_B, a bound set by configuration; not finer
        than MIN_PIECE_NUMEL per rank)."""
        limit = max(self.config.bucket_numel, MIN_PIECE_NUMEL * self.comm.world_size)
        chunks, start, stop = [], 0, 0
        for slot in group:
            if stop > start and stop + slot.numel - start > limit:
                chunks.append((start, stop))
                start = stop
            stop += slot.numel
            while stop - start > limit:
                chunks.append((start, start + limit))
                start += limit
        if stop > start:
            chunks.append((start, stop))
        return chunks

    def _reduced(self) -> list[torch.Tensor]:
        return self._accumulated if self._accumulated is not None else self.flats

    def float32_gradients(self) -> list[GroupGradient]:
        """Per group, the reduced gradient in float32: the buffer itself when it is
        float32 (step() scales it in place and clears it after; between backward and
        step ``p.grad`` still reads the reduced sum), else a float32 copy."""
        return [g if g.dtype == torch.float32 else g.float() for g in self._reduced()]

    def row_sums(self, gradients: list[GroupGradient]) -> torch.Tensor:
        """The grad_norm row sums of every parameter, in parameter order."""
        rows = [
            param_row_sums(gradients[slot.group][slot.flat.start : slot.flat.stop])
            for slot in self.slots
        ]
        return torch.cat(rows) if rows else torch.zeros(0, device=self.comm.device)

    def any_rank(self, flag: bool) -> bool:
        return flag  # every rank holds the same reduced gradients

    def clear(self) -> None:
        # Nothing to zero: the next backward copies every gradient into its view (or zeros
        # it, for a parameter without one), and its first micro-step copies into the
        # accumulation.
        drop_grad_views(self.slots)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.flats, *(self._accumulated or [])]

    def step_bytes(self) -> int:
        """Bytes the gradients take (held all the time: p.grad views into them)."""
        return tensor_bytes(self.tensors())

    # Stage 0 never offloads: its whole gradients are all-reduced on the device.
    host_bytes = 0

    def in_flight_bytes(self) -> int:
        return 0


def restore_grad_view(slot: ParamSlot, add: bool = False) -> None:
    """Make ``slot.param.grad`` the engine's flat-buffer view again (stages 0 and 1 keep
    gradients as views that autograd fills in place): zeros if backward gave it no
    gradient, a copy if something replaced the view. ``add``: the gradient is added to
    the view instead (a later micro-batch slot, zero_core.slot_rows), none adds nothing."""
    param, view = slot.param, slot.grad_view
    assert view is not None
    if param.grad is None:
        if not add:
            view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        if add:
            view.add_(param.grad.reshape(-1))
        else:
            view.copy_(param.grad.reshape(-1))
    param.grad = view.view(slot.shape)


def land_in_buffer(slot: ParamSlot, again: bool) -> None:
    """Cast ``slot.param.grad`` into ``slot.grad_view``, a view of a buffer in a wider
    dtype than the parameter (``ZeroConfig.reduce_dtype``), and drop ``.grad``: copied, or
    added when it is the parameter's second gradient of this micro-step (``again``: a
    reentrant checkpoint's), in the buffer's dtype; zeros for a first arrival without one."""
    param, view = slot.param, slot.grad_view
    assert view is not None
    if param.grad is not None:
        gradient = param.grad.reshape(-1)
        if again:
            view.add_(gradient)  # promoted: the sum rounds once, in the buffer's dtype
        else:
            view.copy_(gradient)  # exact: every compute dtype widens losslessly
        param.grad = None
    elif not again:
        view.zero_()


def drop_grad_views(slots: ParamTable) -> None:
    """After a step, ``.grad = None`` on every parameter (as torch's
    ``zero_grad(set_to_none=True)``) instead of zeroing the flat buffer it viewed.

    The next backward's gradient then arrives as a tensor of its own, which
    restore_grad_view copies into the view: one pass over the gradients, where zeroing
    the buffer for autograd to add into took two (the zeroing, then an add that reads
    the zeros; 9 of stage 0's 86 ms step at 19M parameters). The buffer's elements that
    no parameter covers (padding) are never written by a copy and stay zero: their
    reduction sums zeros. Between a step and the next backward (and before the first)
    ``.grad`` reads None, so a gradient found there then came from a backward the engine
    did not see (ZeroEngine.step names it)."""
    for slot in slots:
        slot.param.grad = None
