"""``deepspeed.utils``: one parameter's whole values, and ``zero_to_fp32``.

    w = safe_get_full_fp32_param(model.lm_head.weight)     # float32, whole
    g = safe_get_full_grad(model.lm_head.weight)           # between backward and step
    m = safe_get_full_optimizer_state(model.lm_head.weight, "exp_avg")

Each is collective at stages 1-3 (every rank calls it, for the same parameter, in the same
order) and returns None for a parameter no facade engine trains, as DeepSpeed's return
None for one without ZeRO state. The gradient is the one the next step applies: the mean
over ranks and accumulation steps, float32, before clipping, and without float16's loss
scale (DeepSpeed's may still carry it); None outside backward..step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..unsupported import refusing_module_getattr
from . import zero_to_fp32
from .full_values import full_gradient, full_master, full_optimizer_state, owned
from .zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "zero_to_fp32",
]


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s float32 master value, whole, shaped like it (collective)."""
    found = owned(param)
    return None if found is None else full_master(*found)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s gradient as the next step applies it (module doc; collective)."""
    found = owned(param)
    return None if found is None else full_gradient(*found)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """``param``'s optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``),
    whole, float32 (collective); None before the first step."""
    found = owned(param)
    return None if found is None else full_optimizer_state(*found, optim_state_key)


__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.utils",
    "provided: safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, "
    "zero_to_fp32",
    "",
)
