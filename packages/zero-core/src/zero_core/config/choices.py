"""The values the options take: compute dtypes by name, stages, offload tiers, and the
rule of which tiers a stage can use (one home for ZeroConfig, the DeepSpeed translation,
zero-estimate and zero-train)."""

from __future__ import annotations

import torch

# The compute dtypes by their short names (the command lines' --dtype), and every name
# param_dtype accepts: the one home of these maps.
SHORT_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {
    **SHORT_DTYPE_NAMES,
    **{str(dtype).removeprefix("torch."): dtype for dtype in SHORT_DTYPE_NAMES.values()},
}
AVAILABLE_STAGES = (0, 1, 2, 3)
DEFAULT_STAGE = 2
# Where offloaded model states go: "cpu" is host memory (the device itself on a CPU-only
# machine), "disk" is swap files under ``offload_dir``.
OFFLOAD_DEVICES = ("none", "cpu", "disk")


def offload_stage_error(stage: int, offload_optimizer: str, offload_params: str) -> str:
    """Why these tiers cannot be used at ``stage`` ("" if they can): the one statement of
    the rule, for ZeroConfig, zero-estimate and zero-train."""
    if offload_optimizer != "none" and stage == 0:
        return (
            f"offload_optimizer={offload_optimizer!r} needs stage 1, 2 or 3 (stage 0 "
            "replicates the optimizer states; there is nothing sharded to offload)"
        )
    if offload_params != "none" and stage != 3:
        return (
            f"offload_params={offload_params!r} needs stage=3 (only stage 3 partitions the "
            f"parameters); this config has stage={stage}"
        )
    return ""


def parse_dtype(value: torch.dtype | str, field: str = "param_dtype") -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(
        f"{field}={value!r} is not supported; use one of float32, bfloat16, float16 "
        "(or the strings 'fp32', 'bf16', 'fp16')"
    )
