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
from .reduced_gradient import GroupGradient

RowSums = Callable[[list[GroupGradient]], torch.Tensor]


# Elements per piece that divide_and_check_finite divides and then sums on the CPU: small
# enough that the sum reads the piece from the cache the division left it in (512 KiB of
# float32, within a core's L2), large enough that the per-piece calls cost little (19M
# elements: 146 pieces; 2^16 ran as fast, 2^20 and the whole tensor about 30% slower).
# On an accelerator each piece would be two kernel launches for no cache to gain, so
# there a tensor is one piece.
CACHE_PIECE_NUMEL = 1 << 17


def divide_and_check_finite(
    tensors: Iterable[torch.Tensor], denominator: float, chunk_numel: int
) -> bool:
    """``t.div_(denominator)`` for every tensor (contiguous: each is divided through a
    flat view of it); then whether every element of every tensor is finite.

    The same bits as dividing each tensor whole (division is elementwise), in one pass
    over memory where dividing, then checking, took two: on the CPU each piece of
    CACHE_PIECE_NUMEL elements is summed right after it is divided, while it is still in
    the cache (19M float32 gradients on one thread: 5.4 ms, against 5.6 ms for the
    division and 2.8 ms for the sum apart).

    The check: a sum is NaN or Inf whenever any element is (Inf + x is Inf, Inf - Inf and
    NaN + x are NaN), so a finite sum proves every element finite, in one read of the data
    (isfinite reads it four times and writes three temporaries: it was two thirds of stage
    0's step on the CPU). A non-finite sum is either a non-finite element or an overflow of
    finite ones (|sum| > 3.4e38); the exact check, ``chunk_numel`` elements at a time so
    that its temporaries stay within a bucket, tells the two apart. Half-precision tensors
    are summed in float32 (their range, 65504, is easily exceeded by finite values). The
    answers stay on the device and are read once per path: a read per chunk synchronised
    the host with a GPU hundreds of times per step."""
    flats = [tensor.view(-1) for tensor in tensors]  # a copy would be divided in vain
    sums = []
    for flat in flats:
        piece_numel = CACHE_PIECE_NUMEL if flat.device.type == "cpu" else max(flat.numel(), 1)
        for piece in torch.split(flat, piece_numel):
            piece.div_(denominator)
            sums.append(_sum32(piece))
    if not sums or bool(torch.isfinite(torch.stack(sums)).all()):
        return True
    flags = [
        torch.isfinite(part).all() for flat in flats for part in torch.split(flat, chunk_numel)
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
