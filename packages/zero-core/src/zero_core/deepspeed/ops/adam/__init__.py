"""``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's ``AdamW`` (or ``Adam``) with the same options.

DeepSpeed-Chat and many scripts import them at the top (``from deepspeed.ops.adam import
FusedAdam``), so refusing them would stop a script that otherwise runs. They are provided
rather than refused because they are not other algorithms: both compute Adam's update,
with decoupled weight decay by default (``adam_w_mode=True``), which is what
``torch.optim.AdamW`` computes (``adam_w_mode=False``: ``torch.optim.Adam``'s L2 decay).
The engine rebuilds the optimizer over its own master weights anyway, so the kernel that
runs is always torch's: the values agree with DeepSpeed's kernels within float rounding,
not bit for bit. Options that torch's classes cannot honour (``bias_correction=False``,
FusedAdam's ``amsgrad=True``) raise naming themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ...unsupported import refuse_unless_default

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def FusedAdam(  # DeepSpeed's class name, called like a class
    params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adam_w_mode: bool = True,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    set_grad_none: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam as ``torch.optim.AdamW`` (``adam_w_mode=False``: ``Adam``).
    ``set_grad_none`` changes nothing here (the engine owns the gradients)."""
    refuse_unless_default(
        "FusedAdam",
        {
            "bias_correction": (bias_correction, True, "torch's Adam always corrects bias"),
            "amsgrad": (amsgrad, False, "DeepSpeed's FusedAdam refuses it too"),
        },
    )
    chosen = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return chosen(params, lr=lr, betas=(betas[0], betas[1]), eps=eps, weight_decay=weight_decay)


def DeepSpeedCPUAdam(  # DeepSpeed's class name, called like a class
    model_params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    adamw_mode: bool = True,
    fp32_optimizer_states: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam as ``torch.optim.AdamW`` (``adamw_mode=False``: ``Adam``);
    where the optimizer runs is the config's ``zero_optimization.offload_optimizer``."""
    refuse_unless_default(
        "DeepSpeedCPUAdam",
        {
            "bias_correction": (bias_correction, True, "torch's Adam always corrects bias"),
            "fp32_optimizer_states": (
                fp32_optimizer_states,
                True,
                "the engine keeps optimizer states in float32",
            ),
        },
    )
    chosen = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return chosen(
        model_params,
        lr=lr,
        betas=(betas[0], betas[1]),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
    )
