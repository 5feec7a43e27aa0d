"""``ZeroConfig``: what the engine is asked to do, validated when it is made.

    ZeroConfig(stage=2, param_dtype="bf16", bucket_numel=2**22, clip_grad_norm=1.0)
    ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})

A DeepSpeed-style dict is accepted for the keys listed in ``DEEPSPEED_KEYS``; any other key
is rejected by name rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The compute dtypes by their short names (the command lines' --dtype), and every name
# param_dtype accepts: the one home of these maps.
SHORT_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {
    **SHORT_DTYPE_NAMES,
    **{str(dtype).removeprefix("torch."): dtype for dtype in SHORT_DTYPE_NAMES.values()},
}
AVAILABLE_STAGES = (0, 1, 2, 3)


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(
        f"param_dtype={value!r} is not supported; use one of float32, bfloat16, float16 "
        "(or the strings 'fp32', 'bf16', 'fp16')"
    )


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of one engine.

    stage: 0 (plain data parallelism), 1 (partition optimizer states), 2 (+ gradients),
        3 (+ parameters, gathered module by module just in time).
    param_dtype: dtype of the compute parameters and gradients; the master weights and
        optimizer states are float32 whenever this is bfloat16 or float16.
    bucket_numel: elements per gradient bucket (reduce-scatter) and parameter all-gather;
        bounds the communication buffers whatever the model's size.
    gradient_accumulation_steps: backward calls per optimizer update.
    clip_grad_norm: clip gradients to this global L2 norm; None disables clipping.
    loss_scale: float16 only: 0 means dynamic loss scaling, > 0 a fixed scale.
    initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale: dynamic scaling
        starts at ``initial_loss_scale``, doubles after ``loss_scale_window`` steps without
        overflow, and halves (not below ``min_loss_scale``) after ``hysteresis`` overflows.
    max_buckets_in_flight: stage 2: reduce-scatters outstanding at once during backward.
    prefetch_numel: stage 3: parameter elements gathered ahead of use (in the order recorded
        on the first step); 0 turns prefetching off.
    max_live_numel: stage 3: prefetching never makes more parameter elements gathered at
        once than this (the modules running now are always gathered, whatever their size).
    persistence_threshold: stage 3: parameters of at most this many elements (biases, norm
        weights) stay gathered on every rank; their gradients and optimizer states are
        still partitioned. 0 partitions every parameter.
    allow_untested_optimizer: accept an optimizer not known to be elementwise.
    nonfinite: what a NaN or Inf in the reduced gradients does (float16 always skips and
        backs the loss scale off): "skip" the step on every rank, or "raise" a
        FloatingPointError naming the first parameter (in model order) that went non-finite.
        Either way a NaN never reaches the parameters.
    cast_forward_inputs: floating-point tensors given to the engine's forward (also inside
        tuples, lists and dicts) are cast to ``param_dtype`` first, as FSDP2's
        MixedPrecisionPolicy does, so float32 data feeds a bfloat16 model. False passes
        them as they are.
    """

    stage: int = 2
    param_dtype: torch.dtype = torch.float32
    bucket_numel: int = 2**22
    gradient_accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    loss_scale: float = 0.0
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    max_buckets_in_flight: int = 2
    prefetch_numel: int = 2**24
    max_live_numel: int = 2**28
    persistence_threshold: int = 2**12
    allow_untested_optimizer: bool = False
    nonfinite: str = "skip"
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype))
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (
            0, 1, 2, 3,
        ):  # fmt: skip
            raise ValueError(f"stage={self.stage!r}: ZeRO stages are 0, 1, 2 and 3")
        for name in ("bucket_numel", "gradient_accumulation_steps", "loss_scale_window",
                     "hysteresis", "max_buckets_in_flight"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
                raise ValueError(f"{name}={value!r} must be a number")
        for name in ("prefetch_numel", "max_live_numel", "persistence_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.clip_grad_norm is not None and not isinstance(self.clip_grad_norm, int | float):
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r} must be a number or None")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite={self.nonfinite!r} must be 'skip' or 'raise'")
        for name in ("allow_untested_optimizer", "cast_forward_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.clip_grad_norm is not None and not (
            math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0
        ):
            raise ValueError(
                f"clip_grad_norm={self.clip_grad_norm!r} must be a positive number, or None "
                "to disable clipping"
            )
        if self.loss_scale < 0:
            raise ValueError(f"loss_scale={self.loss_scale!r}: use 0 for dynamic, > 0 for fixed")
        if not self.initial_loss_scale >= self.min_loss_scale > 0:
            raise ValueError(
                f"need initial_loss_scale ({self.initial_loss_scale}) >= min_loss_scale "
                f"({self.min_loss_scale}) > 0"
            )
        if self.loss_scale and self.param_dtype is not torch.float16:
            raise ValueError("loss_scale applies to param_dtype=float16 only; remove it")

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any]) -> ZeroConfig:
        """Read the supported keys of a DeepSpeed config dict; reject every other key."""
        return cls(**_translate_deepspeed(config))


DEEPSPEED_KEYS: dict[str, str | dict[str, str | None]] = {
    "zero_optimization": {
        "stage": "stage",
        "reduce_bucket_size": "bucket_numel",
        "stage3_prefetch_bucket_size": "prefetch_numel",
        "stage3_max_live_parameters": "max_live_numel",
        "stage3_param_persistence_threshold": "persistence_threshold",
    },
    "bf16": {"enabled": None},
    "fp16": {
        "enabled": None,
        "loss_scale": "loss_scale",
        "initial_scale_power": None,
        "loss_scale_window": "loss_scale_window",
        "hysteresis": "hysteresis",
        "min_loss_scale": "min_loss_scale",
    },
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "clip_grad_norm",
}


def _translate_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config must be a dict, got {type(config).__name__}")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key not in DEEPSPEED_KEYS:
            raise ValueError(
                f"DeepSpeed config key {key!r} is not supported by zero_core; supported: "
                f"{', '.join(sorted(DEEPSPEED_KEYS))}. Remove it (batch sizes belong to your "
                "data loader)"
            )
        target = DEEPSPEED_KEYS[key]
        if isinstance(target, str):
            out[target] = value
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"DeepSpeed config {key!r} must be a dict, got {value!r}")
        for sub, sub_value in value.items():
            if sub not in target:
                raise ValueError(
                    f"DeepSpeed config key {key}.{sub} is not supported by zero_core; "
                    f"supported under {key!r}: {', '.join(target)}"
                )
            name = target[sub]
            if name is not None:
                out[name] = sub_value
    if out.get("clip_grad_norm") == 0:
        out["clip_grad_norm"] = None  # DeepSpeed's default, meaning no clipping
    bf16 = config.get("bf16", {}).get("enabled", False) is True
    fp16 = config.get("fp16", {}).get("enabled", False) is True
    if bf16 and fp16:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable one of them")
    if fp16:
        out["param_dtype"] = torch.float16
        power = config["fp16"].get("initial_scale_power")
        if power is not None:
            if not isinstance(power, int) or isinstance(power, bool) or not 0 <= power < 128:
                raise ValueError(f"fp16.initial_scale_power={power!r} must be an integer 0-127")
            out["initial_loss_scale"] = 2.0**power
    else:
        # A disabled fp16 section's settings do not apply.
        for name in ("loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
            out.pop(name, None)
        if bf16:
            out["param_dtype"] = torch.bfloat16
    for name in ("bucket_numel", "prefetch_numel", "max_live_numel", "persistence_threshold"):
        size = out.get(name)
        if isinstance(size, float) and size.is_integer():
            out[name] = int(size)  # DeepSpeed configs write 5e8
    return out
