"""Gradients replicated on every rank (stage 0), all-reduced after each backward.

As DDP does with ``gradient_as_bucket_view``, each group's gradients are views into one
flat buffer that autograd fills in place (the group's layout: one bucket, no gaps):

    group g   | grad p0 | grad p1 | grad p2 |   p.grad = views; all-reduced in chunks of
                                                 at most bucket_numel elements

With accumulation, the reduced gradients are summed into a second buffer of the same size.
"""

from __future__ import annotations

import torch

from zero_comm import Communicator

from .config import ZeroConfig
from .grad_norm import param_row_sums
from .group_layout import MIN_PIECE_NUMEL, GroupLayout
from .param_table import ParamSlot, ParamTable


class AllReducedGradients:
    """Whole gradients on every rank, as views of one flat buffer per group."""

    grads_are_views = True  # p.grad is the engine's storage between steps

    def __init__(
        self,
        slots: ParamTable,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        comm: Communicator,
        config: ZeroConfig,
    ) -> None:
        self.slots = slots
        self.comm = comm
        self.config = config
        self.flats = [torch.zeros(layout.padded_numel, dtype=dtype) for layout in layouts]
        for slot in slots:
            flat = self.flats[slot.group]
            slot.grad_view = flat[slot.flat.start : slot.flat.stop]
            slot.param.grad = slot.grad_view.view(slot.shape)
        accumulate = config.gradient_accumulation_steps > 1
        self._accumulated = [torch.zeros_like(g) for g in self.flats] if accumulate else None
        self._label = ""

    def before_backward(self, first_micro_step: bool, label: str) -> None:
        self._label = label

    def after_backward(self, first_micro_step: bool) -> None:
        """All-reduce this micro-step's gradients, and add them into the accumulation."""
        for group, flat in zip(self.slots.by_group, self.flats, strict=True):
            for slot in group:
                restore_grad_view(slot)
            for start, stop in self._chunks(group):
                self.comm.all_reduce(flat[start:stop], label="gradients" + self._label)
        if self._accumulated is not None:
            for total, flat in zip(self._accumulated, self.flats, strict=True):
                if first_micro_step:
                    total.copy_(flat)
                else:
                    total.add_(flat)
                flat.zero_()

    def end_backward(self) -> None:
        return None

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

    def float32_gradients(self) -> list[torch.Tensor]:
        """Per group, the reduced gradient as a new float32 tensor."""
        return [g.to(torch.float32, copy=True) for g in self._reduced()]

    def row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """The grad_norm row sums of every parameter, in parameter order."""
        rows = [
            param_row_sums(gradients[slot.group][slot.flat.start : slot.flat.stop])
            for slot in self.slots
        ]
        return torch.cat(rows) if rows else torch.zeros(0)

    def any_rank(self, flag: bool) -> bool:
        return flag  # every rank holds the same reduced gradients

    def clear(self) -> None:
        for buffers in (self.flats, self._accumulated or []):
            for flat in buffers:
                flat.zero_()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.flats, *(self._accumulated or [])]


def restore_grad_view(slot: ParamSlot) -> None:
    """Make ``slot.param.grad`` the engine's flat-buffer view again (stages 0 and 1 keep
    gradients as views that autograd fills in place): zeros if backward gave it no
    gradient, a copy if something replaced the view."""
    param, view = slot.param, slot.grad_view
    assert view is not None
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad.reshape(-1))
    param.grad = view.view(slot.shape)
