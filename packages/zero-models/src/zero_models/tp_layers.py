"""Megatron-style tensor-parallel layers on a zero_comm Communicator (the TP group of p ranks).

Each layer is built from the full (TP = 1) layer and keeps this rank's slice of it, so a
TP = p model built from a seed holds exactly the slices of the TP = 1 model of that seed:

    ColumnParallelLinear   A = [A_1 ... A_p] split on outputs:  Y_i = X A_i + b_i
                           (``groups`` > 1 splits each of several stacked outputs, e.g. the
                           q, k, v thirds of an attention projection, so rank i gets its heads)
    RowParallelLinear      A = [A_1; ...; A_p] split on inputs: Y = sum_i X_i A_i + b
    VocabParallelEmbedding rows [i V/p, (i+1) V/p) of the table; other ids give zeros; summed
    VocabParallelHead      logits for this rank's V/p vocabulary slice (weight may be tied)
    vocab_parallel_cross_entropy   the loss from vocabulary-sharded logits, never gathering them
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from zero_comm import Communicator, ReduceOp

from .tp_mappings import copy_to_tp, reduce_from_tp


def _split(total: int, comm: Communicator, what: str) -> int:
    if total % comm.world_size:
        raise ValueError(
            f"{what}={total} does not divide over tensor-parallel degree {comm.world_size}; "
            f"use a tensor-parallel degree that divides {total}, or resize the model"
        )
    return total // comm.world_size


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, comm: Communicator, *, groups: int = 1) -> None:
        super().__init__()
        self.comm = comm
        out = _split(full.out_features // groups, comm, "output features per group")
        rows = [
            torch.arange(g * full.out_features // groups + comm.rank * out,
                         g * full.out_features // groups + (comm.rank + 1) * out,
                         device=full.weight.device)
            for g in range(groups)
        ]  # fmt: skip
        index = torch.cat(rows)
        self.weight = nn.Parameter(full.weight.detach()[index].clone())  # (out/p, in)
        self.bias = (
            nn.Parameter(full.bias.detach()[index].clone()) if full.bias is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)  # (..., out/p)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        width = _split(full.in_features, comm, "input features")
        columns = slice(comm.rank * width, (comm.rank + 1) * width)
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone())  # (out, in/p)
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)  # (..., out), summed over ranks
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        rows = _split(full.num_embeddings, comm, "vocabulary size")
        self.start = comm.rank * rows
        self.weight = nn.Parameter(full.weight.detach()[self.start : self.start + rows].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        vectors = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        vectors = vectors.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(vectors, self.comm)


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary slice: (..., C) -> (..., V/p). Pass the embedding's
    weight to tie them (both are the same V/p rows)."""

    def __init__(self, weight: nn.Parameter, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, comm: Communicator
    ) -> torch.Tensor:
        logits = logits.float()  # (N, V/p)
        width = logits.shape[-1]
        top = logits.max(dim=-1).values.contiguous()
        comm.all_reduce(top, ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1).contiguous()
        comm.all_reduce(total)
        local = targets - comm.rank * width
        inside = (local >= 0) & (local < width)
        picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~inside, 0.0).contiguous()
        comm.all_reduce(picked)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside)
        return total.log() - picked  # (N,) per-token loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, inside = ctx.saved_tensors
        result = softmax.clone()
        rows = torch.arange(result.shape[0], device=result.device)[inside]
        result[rows, local[inside]] -= 1.0
        return result * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, comm: Communicator
) -> torch.Tensor:
    """Mean cross-entropy of vocabulary-sharded ``logits`` (..., V/p) against ``targets``."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    per_token: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat_logits, targets.reshape(-1), comm
    )
    return per_token.mean()
