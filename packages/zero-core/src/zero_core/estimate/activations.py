"""Activation memory of a GPT-2-style transformer step, per rank, predicted from its shape.

The paper's rule of thumb is 12 x width x tokens x layers activations (Rajbhandari et al.
2019, section 3.2). Counting what autograd really keeps in a pre-LayerNorm block with fused
attention (no T x T matrix kept), a 4C GELU MLP and no dropout, for n tokens of width C,
H heads, on p tensor-parallel ranks (elements, k = compute dtype; s = float32):

    ln_1 input x, ln_1 output, ln_2 input, ln_2 output      4 n C     k   (replicated)
    q, k, v (one qkv output) + attention output             4 n C / p k
    fc output (GELU input) + GELU output                    8 n C / p k
    LayerNorm means and inverse deviations, attention's     (4 + H/p) n s
    log-sum-exp per head
    --------------------------------------------------------------------
    one block = n (4 C + 12 C / p) k + n (4 + H / p) s                 ("layer_saved")

(a test counts the saved tensors of the GPT in zero_models with autograd's hooks and finds
exactly this). Checkpointing a block keeps its input only: n C (ordinary) or n C / p (P_a).

The peak of a step is the largest of:

    end of forward      L x kept + head
    head's backward     L x kept + head + n V/p (s + k)     gradient of log-probs and logits
    a block's backward  L x kept + (block + n C k if checkpointed)      recomputed block,
                        + n 8 C / p k                        its gathered input, and the
                                                             two 4C/p-wide gradients in the MLP
    the optimizer step  nothing held by activations

where head = n 2 C k (ln_f input and output) + n V/p (k + s) (logits and float32 log-probs),
and "kept" is one block's saved tensors without checkpointing. Model states and buffers come
on top (``memory_estimate``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

CheckpointMode = Literal["none", "full", "partitioned"]
FLOAT32 = 4


class TransformerShape(NamedTuple):
    layers: int
    width: int
    heads: int
    vocab_size: int
    tokens: int  # per rank per micro-step: micro-batch x sequence length


def shape_problem(shape: TransformerShape, tp: int) -> str:
    """Why ``shape`` cannot be split over ``tp`` tensor-parallel ranks ("" if it can):
    heads must divide the width, and tp each of heads, width and vocabulary."""
    if shape.width % shape.heads:
        return (
            f"width={shape.width} does not divide into heads={shape.heads}; choose a width "
            f"that is a multiple of {shape.heads}"
        )
    for what, size in (("heads", shape.heads), ("width", shape.width),
                       ("vocabulary size", shape.vocab_size)):  # fmt: skip
        if size % tp:
            return (
                f"{what}={size} does not divide over tensor-parallel degree {tp}; use a --tp "
                f"that divides {size}"
            )
    return ""


class ActivationBytes(NamedTuple):
    """Bytes one rank holds for activations: ``kept`` across the whole forward (saved
    tensors, or checkpoints), ``peak`` at the highest point of forward and backward."""

    kept: float
    peak: float


def paper_activation_elements(shape: TransformerShape) -> float:
    """The paper's 12 x hidden x batch x sequence x layers."""
    return 12.0 * shape.width * shape.tokens * shape.layers


def block_saved_bytes(shape: TransformerShape, tp: int = 1, dtype_bytes: int = 4) -> float:
    """Bytes one block keeps for backward without checkpointing (the table above)."""
    n, c, p = shape.tokens, shape.width, tp
    return n * (4 * c + 12 * c / p) * dtype_bytes + n * (4 + shape.heads / p) * FLOAT32


def checkpoint_bytes(
    shape: TransformerShape, tp: int = 1, mode: CheckpointMode = "full", dtype_bytes: int = 4
) -> float:
    """Bytes one checkpointed block keeps: its input, whole or a 1/p piece (P_a)."""
    numel = shape.tokens * shape.width
    if mode == "partitioned":
        numel = math.ceil(numel / tp)
    return float(numel * dtype_bytes)


def activation_bytes(
    shape: TransformerShape,
    *,
    tp: int = 1,
    checkpoint: CheckpointMode = "none",
    dtype_bytes: int = 4,
) -> ActivationBytes:
    """Kept and peak activation bytes of one training step on one rank."""
    if checkpoint not in ("none", "full", "partitioned"):
        raise ValueError(f"checkpoint mode {checkpoint!r} is not 'none', 'full' or 'partitioned'")
    if tp < 1 or min(shape) < 1:
        raise ValueError(f"tensor-parallel degree {tp} and every size in {shape} must be >= 1")
    n, c, k, v = shape.tokens, shape.width, dtype_bytes, shape.vocab_size / tp
    block = block_saved_bytes(shape, tp, dtype_bytes)
    per_layer = block if checkpoint == "none" else checkpoint_bytes(shape, tp, checkpoint, k)
    kept = shape.layers * per_layer
    head = n * 2 * c * k + n * v * (k + FLOAT32)
    head_backward = head + n * v * (FLOAT32 + k)
    recompute = (block + n * c * k) if checkpoint != "none" else 0.0
    block_backward = recompute + n * 8 * c / tp * k
    return ActivationBytes(kept=kept, peak=kept + max(head_backward, block_backward))
