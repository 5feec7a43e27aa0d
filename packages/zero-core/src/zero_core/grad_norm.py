"""A global gradient norm whose value does not depend on how the gradient is partitioned.

A float sum depends on the order of its terms, so a norm summed shard by shard would
change with the world size. Instead:

    1. every parameter's gradient is cut into rows of ``BLOCK`` elements from its own start,
       the last row padded with zeros (the flat layouts start every parameter at a multiple
       of BLOCK, so a row never straddles two shards);
    2. each row's sum of squares is computed as one length-BLOCK reduction, the same kernel
       on the same values wherever the row lives;
    3. rows whose sum is exactly zero are dropped (padding rows exist in some layouts and not
       others; dropping every zero keeps the sequences equal), and the remaining row sums,
       in parameter order, are added in float64 by one reduction.

Stage 0 and the partitioned stages call the same functions, so clipping coefficients are
bit-identical at every world size.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128


def row_sums_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """Sums of squares of consecutive BLOCK-element rows of ``flat`` (numel % BLOCK == 0)."""
    if flat.numel() % BLOCK:
        raise ValueError(f"a flat gradient of {flat.numel()} elements is not in BLOCK rows")
    return flat.view(-1, BLOCK).square().sum(dim=1)


def param_row_sums(grad: torch.Tensor) -> torch.Tensor:
    """Row sums of one parameter's (float32) gradient, its last row padded with zeros."""
    flat = grad.reshape(-1)
    padded = flat.new_zeros(-(-flat.numel() // BLOCK) * BLOCK)
    padded[: flat.numel()] = flat
    return row_sums_of_squares(padded)


def norm_from_row_sums(row_sums: torch.Tensor) -> float:
    """The L2 norm from row sums listed in parameter order (zeros anywhere are ignored)."""
    nonzero = row_sums[row_sums != 0]
    return math.sqrt(float(nonzero.double().sum()))


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor to multiply gradients by, or None when they are within ``max_norm``.

    As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), applied only when < 1.
    """
    coefficient = max_norm / (norm + 1e-6)
    return coefficient if coefficient < 1.0 else None
