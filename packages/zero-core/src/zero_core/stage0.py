"""Stage 0: plain data parallelism, the oracle every other stage must equal bit for bit.

Every rank holds everything; per micro-step, the gradients of each group (one flat buffer
in parameter order) are all-reduced; the optimizer updates the full float32 master weights.

    16 elements, N = 4 ranks:   every rank  | p p p p p p p p p p p p p p p p |  (all of it)

Memory per rank (mixed precision Adam, K = 12): (2 + 2 + K) Ψ, plus 2Ψ for the reduced
sum when accumulating over several micro-steps.
Communication per step: one all-reduce of Ψ elements, 2Ψ (N-1)/N in the ring convention.

It is deliberately small and separate from the partitioned stages, which reuse none of it
but the step protocol of engine.ZeroEngine.
"""

from __future__ import annotations

import torch

from .engine import ZeroEngine, restore_grad_view
from .flat_layout import Range
from .grad_norm import param_row_sums
from .group_layout import MIN_PIECE_NUMEL


class DataParallelEngine(ZeroEngine):
    """ZeRO stage 0: full replicas, all-reduced gradients, a full optimizer step.

    As DDP does with ``gradient_as_bucket_view``, each group's gradients are views into one
    flat buffer that autograd fills in place; it is all-reduced in chunks of
    ``bucket_numel`` elements. With accumulation the reduced gradients are summed into a
    second buffer of the same size.
    """

    _keeps_grad_views = True

    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        self._grads = [
            torch.zeros(sum(p.numel() for p in params), dtype=self.dtype)
            for params in self.groups.params
        ]
        self._views: dict[int, torch.Tensor] = {}
        for params, flat in zip(self.groups.params, self._grads, strict=True):
            start = 0
            for p in params:
                self._views[id(p)] = flat[start : start + p.numel()]
                p.grad = self._views[id(p)].view(p.shape)
                start += p.numel()
        accumulate = self.config.gradient_accumulation_steps > 1
        self._accumulated = [torch.zeros_like(g) for g in self._grads] if accumulate else None
        masters: list[torch.Tensor] = [
            torch.nn.Parameter(
                torch.cat([initial[id(p)].reshape(-1) for p in params])
                if params
                else torch.zeros(0)
            )
            for params in self.groups.params
        ]
        # float32 compute: each parameter becomes a view of the master (one copy, 16Ψ).
        self._masters_are_parameters = self.dtype == torch.float32
        if self._masters_are_parameters:
            for group, master in enumerate(masters):
                for p, where in self._param_ranges(group):
                    p.data = master.detach()[where].view(p.shape)
        return masters

    def _reduce_gradients(self, first_micro_step: bool) -> None:
        for params, flat in zip(self.groups.params, self._grads, strict=True):
            for p in params:
                restore_grad_view(p, self._views[id(p)])
            for start, stop in self._chunks(params):
                self.comm.all_reduce(flat[start:stop], label="gradients" + self.micro_step_label)
        if self._accumulated is not None:
            for total, flat in zip(self._accumulated, self._grads, strict=True):
                if first_micro_step:
                    total.copy_(flat)
                else:
                    total.add_(flat)
                flat.zero_()

    def _chunks(self, params: tuple[torch.nn.Parameter, ...]) -> list[tuple[int, int]]:
        """Ranges of at most ``bucket_numel`` elements, ending at parameter boundaries
        where whole parameters fit; a larger parameter is cut into ``bucket_numel`` pieces
        (the communicator stages each range: C_B, a bound set by configuration; not finer
        than MIN_PIECE_NUMEL per rank)."""
        limit = max(self.config.bucket_numel, MIN_PIECE_NUMEL * self.comm.world_size)
        chunks, start, stop = [], 0, 0
        for p in params:
            if stop > start and stop + p.numel() - start > limit:
                chunks.append((start, stop))
                start = stop
            stop += p.numel()
            while stop - start > limit:
                chunks.append((start, start + limit))
                start += limit
        if stop > start:
            chunks.append((start, stop))
        return chunks

    def _reduced(self) -> list[torch.Tensor]:
        return self._accumulated if self._accumulated is not None else self._grads

    def _float32_gradients(self) -> list[torch.Tensor]:
        return [g.to(torch.float32, copy=True) for g in self._reduced()]

    def _row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        rows = [
            param_row_sums(g[where])
            for group, g in enumerate(gradients)
            for _, where in self._param_ranges(group)
        ]
        return torch.cat(rows) if rows else torch.zeros(0)

    def _param_ranges(self, group: int) -> list[tuple[torch.nn.Parameter, slice]]:
        ranges, start = [], 0
        for p in self.groups.params[group]:
            ranges.append((p, slice(start, start + p.numel())))
            start += p.numel()
        return ranges

    def _any_rank(self, flag: bool) -> bool:
        return flag  # every rank holds the same reduced gradients

    def _publish_parameters(self) -> None:
        if self._masters_are_parameters:
            return  # the parameters are views of the masters the optimizer just updated
        for p, value in self._master_views():
            p.data.copy_(value)

    def _clear_gradients(self) -> None:
        for buffers in (self._grads, self._accumulated or []):
            for flat in buffers:
                flat.zero_()

    def _full_master_values(self) -> dict[int, torch.Tensor]:
        return {id(p): value for p, value in self._master_views()}

    _replicated_master = True

    def _shard_pieces(self, group: int) -> list[tuple[int, Range, int]]:
        return [
            (i, Range(0, p.numel()), where.start or 0)
            for i, (p, where) in enumerate(self._param_ranges(group))
        ]

    def _write_back(self, wanted: set[int]) -> None:
        for p, value in self._master_views():
            if id(p) in wanted:
                value.copy_(p.detach())

    def _master_views(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each trainable parameter with its view of the full float32 master weights."""
        return [
            (p, master.detach()[where].view(p.shape))
            for group, master in enumerate(self.masters)
            for p, where in self._param_ranges(group)
        ]

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        return [*self._grads, *(self._accumulated or [])]
