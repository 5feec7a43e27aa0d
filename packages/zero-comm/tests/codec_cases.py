"""Inputs and tolerances shared by the tests of ZeRO++'s codec (test_block_quantize.py) and
of its collectives (test_quantized.py).

Tolerances. The codec's error per element is half its block's scale s = absmax / qmax,
plus float32 rounding: the quotient x / s is rounded once before ``round`` and the decoded
code * s once after, each at most qmax * s * 2^-24, so ``codec_slack(qmax) * s`` covers
both; decoding into bfloat16 or float16 adds half an ulp of that dtype (``cast_slack``).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from zero_comm.block_quantize import BlockQuantizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
U = 2.0**-24  # float32's unit roundoff


def codec_slack(qmax: int) -> float:
    """Float32 rounding of encode and decode, in units of the block's scale."""
    return (2 * qmax + 1) * U


def cast_slack(dtype: torch.dtype, value: torch.Tensor) -> torch.Tensor:
    """At least half an ulp of ``dtype`` at ``value`` (0 for float32, decoded in float32)."""
    if dtype == torch.float32:
        return torch.zeros_like(value, dtype=torch.float64)
    info = torch.finfo(dtype)
    return value.double().abs() * info.eps + info.tiny * info.eps


def quantizers() -> st.SearchStrategy[BlockQuantizer]:
    def build(bits: int, block: int) -> BlockQuantizer:
        return BlockQuantizer(bits, block + block % 2 if bits == 4 else block)  # int4: even

    return st.builds(build, st.sampled_from([8, 4]), st.integers(1, 40))


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spread over 2^-12..2^8 within blocks, with runs of zeros (all-zero blocks)."""
    generator = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=generator, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-12, 9, (numel,), generator=generator).double()
    if numel:
        start = int(torch.randint(0, numel, (1,), generator=generator))
        x[start : start + int(torch.randint(0, 12, (1,), generator=generator))] = 0
    return x.to(dtype)


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the float32 absmax of its block (blocks from the start of ``x``)."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32)
    padded[:n] = x.float().abs()
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


def scale_of(x: torch.Tensor, quantizer: BlockQuantizer) -> torch.Tensor:
    """Per element, its block's scale, as the codec defines it: float32 absmax / qmax."""
    return block_absmax(x, quantizer.block_numel) / quantizer.qmax
