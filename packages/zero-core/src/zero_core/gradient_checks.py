"""The checks step() makes on the reduced gradients: finite everywhere, the first
non-finite parameter named, and the global gradient norm's rows with model parallelism.

Each is collective where its answer must be the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from zero_comm import Communicator, ReduceOp

from .model_parallel import ModelParallel
from .param_table import ParamTable
from .shard_gradient import GroupGradient

RowSums = Callable[[list[GroupGradient]], torch.Tensor]


def all_finite(tensors: Iterable[torch.Tensor], chunk_numel: int) -> bool:
    """Whether every element of every tensor is finite.

    Fast path: one sum per tensor. A sum is NaN or Inf whenever any element is (Inf + x is
    Inf, Inf - Inf and NaN + x are NaN), so a finite sum proves every element finite, in
    one read of the data (isfinite reads it four times and writes three temporaries: it was
    two thirds of stage 0's step on the CPU). A non-finite sum is either a non-finite
    element or an overflow of finite ones (|sum| > 3.4e38); the exact check, ``chunk_numel``
    elements at a time so that its temporaries stay within a bucket, tells the two apart.
    Half-precision tensors are summed in float32 (their range, 65504, is easily exceeded by
    finite values). The answers stay on the device and are read once per path: a read per
    chunk synchronised the host with a GPU hundreds of times per step."""
    tensors = list(tensors)
    if not tensors:
        return True
    sums = torch.stack([_sum32(t) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    flags = [
        torch.isfinite(part).all()
        for tensor in tensors
        for part in torch.split(tensor.reshape(-1), chunk_numel)
    ]
    return bool(torch.stack(flags).all())


def _sum32(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s elements, accumulated in at least float32."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.sum(dtype=torch.float32)
    return tensor.sum()


def first_nonfinite_message(
    module: nn.Module, slots: ParamTable, gradients: list[GroupGradient], comm: Communicator,
    global_steps: int,
) -> str:  # fmt: skip
    """Collective: the message naming the first parameter, in model order, whose reduced
    gradient is not finite on any rank (the same message on every rank); ``gradients``
    are this rank's, per group, laid out as the slots' pieces say."""
    names = [name for name, _ in module.named_parameters()]
    first = len(names)
    for slot in slots:
        g = gradients[slot.group]
        for piece in slot.pieces:
            where = piece.local_range
            if not bool(torch.isfinite(g[where.start : where.stop]).all()):
                first = min(first, slot.model_index)
    token = torch.tensor([first], dtype=torch.int64, device=comm.device)
    comm.all_reduce(token, ReduceOp.MIN)
    name = names[int(token.item())] if token.item() < len(names) else "?"
    return (
        f"[rank {comm.rank}] the gradient of parameter {name} is NaN or Inf after "
        f"step {global_steps}; no update was applied (ZeroConfig(nonfinite='skip') "
        "skips such steps instead)"
    )


def model_parallel_rows(
    slots: ParamTable, gradients: list[GroupGradient], mp: ModelParallel, row_sums: RowSums
) -> torch.Tensor:
    """Collective over the model-parallel group: the row sums of the whole model's
    gradient, every model-parallel rank's in rank order, each counting the parameters
    ``mp`` says it counts (see model_parallel.py); ``row_sums`` lists one data-parallel
    group's rows in parameter order."""
    counted = [g.clone() for g in gradients]
    for slot in slots:
        if not mp.counts_for_norm(slot.tensor_parallel):
            for piece in slot.pieces:
                counted[slot.group][piece.local_range.start : piece.local_range.stop] = 0.0
    rows = row_sums(counted)
    everyone = rows.new_empty(mp.comm.world_size * rows.numel())
    mp.comm.all_gather(everyone, rows)
    return everyone


def any_model_parallel_rank(mp: ModelParallel, flag: bool) -> bool:
    """Collective over the model-parallel group: whether ``flag`` is true on any rank."""
    token = torch.tensor([int(flag)], dtype=torch.int32, device=mp.comm.device)
    mp.comm.all_reduce(token, ReduceOp.MAX)
    return bool(token.item())
