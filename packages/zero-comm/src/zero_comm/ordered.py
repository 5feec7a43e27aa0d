"""Reductions that add the ranks' contributions in rank order.

A rank-ordered sum of N contributions is the left fold

    ((x_0 + x_1) + x_2) + ... + x_{N-1}

computed in the tensor's own dtype (every partial sum rounded to it). It is the same sum
one process computes with ``functools.reduce(operator.add, xs)``, so results do not depend
on the backend, the algorithm, or which rank holds which chunk.

The communicator builds its deterministic collectives from an all-to-all, which moves
each rank's copy of chunk r to rank r, and this local fold:

    reduce_scatter: all_to_all(input) -> (N, c) rows, one per rank -> fold rows -> output
    all_reduce:     pad to N*c, reduce_scatter as above, then all_gather the N folded chunks
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .reduce_op import ReduceOp


def fold_in_order(out: torch.Tensor, rows: Iterable[torch.Tensor], op: ReduceOp) -> None:
    """The left fold of ``rows`` (each the shape of ``out``) into ``out``, in the order
    given; AVG is left as SUM (the caller divides by the number of contributions)."""
    first = True
    for row in rows:
        if first:
            out.copy_(row)
            first = False
        elif op in (ReduceOp.SUM, ReduceOp.AVG):
            out.add_(row)
        elif op is ReduceOp.MAX:
            torch.maximum(out, row, out=out)
        else:
            torch.minimum(out, row, out=out)


def fold_rows(out: torch.Tensor, rows: torch.Tensor, op: ReduceOp) -> None:
    """Reduce ``rows`` (shape (N, c), row i from rank i) into ``out`` (c elements), in order."""
    fold_in_order(out, rows, op)
    if op is ReduceOp.AVG:
        out.div_(rows.shape[0])


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank when ``numel`` is padded to a multiple of ``world_size``."""
    return -(-numel // world_size)
