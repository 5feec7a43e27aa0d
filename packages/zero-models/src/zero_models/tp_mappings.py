"""Tensor-parallel region changes as autograd functions whose backward is the adjoint of
their forward (Megatron-LM's mappings; mesh-transformer-jax's f_psum / g_psum):

    copy_to_tp        forward: identity           backward: all-reduce (sum)
    reduce_from_tp    forward: all-reduce (sum)   backward: identity
    gather_last_dim   forward: all-gather, concat on the last dim
                      backward: this rank's slice of the last dim

A column-parallel linear is ``Y_i = copy_to_tp(X) A_i`` for A = [A_1 ... A_p]; a
row-parallel one is ``Y = reduce_from_tp(X_i A_i)`` for A = [A_1; ...; A_p].
Every collective goes through a zero_comm Communicator (the tensor-parallel group).
"""

from __future__ import annotations

from typing import Any

import torch

from zero_comm import Communicator


def _all_reduce(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def _gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    x = x.contiguous()
    pieces = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(pieces.view(-1), x.view(-1))
    return torch.cat(pieces.unbind(0), dim=-1)  # (..., p * d)


def _slice_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    width = x.shape[-1] // comm.world_size
    return x[..., comm.rank * width : (comm.rank + 1) * width].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _slice_last(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out: torch.Tensor = _CopyToTP.apply(x, comm)  # type: ignore[no-untyped-call]
    return out


def reduce_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out: torch.Tensor = _ReduceFromTP.apply(x, comm)  # type: ignore[no-untyped-call]
    return out


def gather_last_dim(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out: torch.Tensor = _GatherLastDim.apply(x, comm)  # type: ignore[no-untyped-call]
    return out
