"""Stage 0: plain data parallelism, the oracle every other stage must equal bit for bit.

Every rank holds everything; per micro-step, the gradients of each group are flattened in
parameter order and all-reduced; the optimizer updates the full float32 master weights.

    16 elements, N = 4 ranks:   every rank  | p p p p p p p p p p p p p p p p |  (all of it)

Memory per rank (mixed precision Adam, K = 12): (2 + 2 + K) Ψ.
Communication per step: one all-reduce of Ψ elements, 2Ψ (N-1)/N in the ring convention.

It is deliberately small and separate from the partitioned stages, which reuse none of it
but the step protocol of engine.ZeroEngine.
"""

from __future__ import annotations

import torch

from .engine import ZeroEngine
from .grad_norm import param_row_sums


class DataParallelEngine(ZeroEngine):
    """ZeRO stage 0: full replicas, all-reduced gradients, a full optimizer step."""

    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        self._accumulated: list[torch.Tensor | None] = [None] * len(self.groups.params)
        return [
            torch.nn.Parameter(torch.cat([initial[id(p)].reshape(-1) for p in params]))
            if params
            else torch.nn.Parameter(torch.zeros(0))
            for params in self.groups.params
        ]

    def _reduce_gradients(self, first_micro_step: bool) -> None:
        for g, params in enumerate(self.groups.params):
            flat = (
                torch.cat(
                    [
                        p.grad.reshape(-1)
                        if p.grad is not None
                        else torch.zeros(p.numel(), dtype=p.dtype)
                        for p in params
                    ]
                )
                if params
                else torch.zeros(0, dtype=self.dtype)
            )
            for p in params:
                p.grad = None
            self.comm.all_reduce(flat)
            accumulated = self._accumulated[g]
            if first_micro_step or accumulated is None:
                self._accumulated[g] = flat
            else:
                accumulated.add_(flat)

    def _float32_gradients(self) -> list[torch.Tensor]:
        return [
            acc.to(torch.float32, copy=True) if acc is not None else torch.zeros_like(master)
            for acc, master in zip(self._accumulated, self.masters, strict=True)
        ]

    def _row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        rows = []
        for params, g in zip(self.groups.params, gradients, strict=True):
            start = 0
            for p in params:
                rows.append(param_row_sums(g[start : start + p.numel()]))
                start += p.numel()
        return torch.cat(rows) if rows else torch.zeros(0)

    def _any_rank(self, flag: bool) -> bool:
        return flag  # every rank holds the same reduced gradients

    def _publish_parameters(self) -> None:
        for params, master in zip(self.groups.params, self.masters, strict=True):
            start = 0
            for p in params:
                p.data.copy_(master.detach()[start : start + p.numel()].view_as(p))
                start += p.numel()

    def _clear_gradients(self) -> None:
        self._accumulated = [None] * len(self.groups.params)

    def _full_master_values(self) -> dict[int, torch.Tensor]:
        values = {}
        for params, master in zip(self.groups.params, self.masters, strict=True):
            start = 0
            for p in params:
                values[id(p)] = master.detach()[start : start + p.numel()].view(p.shape)
                start += p.numel()
        return values

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        return [*self._accumulated, *(p.grad for p in self.module.parameters())]
