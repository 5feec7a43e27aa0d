"""The rule of ``ZeroConfig.optimizer_in_backward``: which settings it cannot be combined
with, and why (zero_core.optimizer_in_backward explains the fused step itself)."""

from __future__ import annotations

from typing import Any

import torch


def optimizer_in_backward_error(config: Any) -> str:
    """Why ``config`` (a ZeroConfig, checking itself) cannot step the optimizer in backward
    ("" if it can, or is not asked to): the one statement of the rule."""
    if not config.optimizer_in_backward:
        return ""
    conflicts = [
        reason
        for reason, present in (
            (f"stage={config.stage} (it needs stage 3)", config.stage != 3),
            (
                f"clip_grad_norm={config.clip_grad_norm} (clipping needs the global norm of "
                "every gradient before any is applied)",
                config.clip_grad_norm is not None,
            ),
            (
                f"gradient_accumulation_steps={config.gradient_accumulation_steps} (a "
                "gradient is final only at the last micro-step)",
                config.gradient_accumulation_steps > 1,
            ),
            (
                "param_dtype=float16 (the loss scaler must be able to skip a whole step)",
                config.param_dtype is torch.float16,
            ),
            (
                "offloaded model states (their tiers are stepped after backward)",
                config.offloads,
            ),
            (
                "nonfinite='skip' (a NaN is seen after other buckets were applied, so the "
                "step cannot be skipped: set nonfinite='raise')",
                config.nonfinite != "raise",
            ),
        )
        if present
    ]
    if not conflicts:
        return ""
    return (
        "optimizer_in_backward applies each bucket's update as soon as its gradient is "
        "reduced, which cannot be combined with " + "; ".join(conflicts) + ". Change those "
        "settings or set optimizer_in_backward=False"
    )
