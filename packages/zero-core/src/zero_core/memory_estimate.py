"""Model-state memory per rank for each ZeRO stage, from the paper's formulas.

Mixed-precision training with an optimizer that keeps K bytes of state per parameter
(Adam: fp32 master weights, momentum and variance, K = 12) holds, per parameter, 2 bytes of
fp16/bf16 parameters, 2 bytes of gradients and K bytes of optimizer state. With Ψ
parameters on N data-parallel ranks (Rajbhandari et al. 2019, Figure 1):

    stage 0 (DP)          (2 + 2 + K) Ψ
    stage 1 (P_os)        (2 + 2) Ψ + K Ψ / N
    stage 2 (P_os+g)      2 Ψ + (2 + K) Ψ / N
    stage 3 (P_os+g+p)    (2 + 2 + K) Ψ / N

Paper check, Ψ = 7.5e9, N = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB (1 GB = 1e9 bytes).
"""

from __future__ import annotations

from typing import NamedTuple

STAGES = (0, 1, 2, 3)
ADAM_STATE_BYTES = 12
# float32 bytes per parameter an optimizer keeps, besides the fp32 master copy.
OPTIMIZER_STATE_BYTES = {
    "adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4, "rmsprop": 4,
}  # fmt: skip


def state_bytes_per_param(param_bytes: int, optimizer: str = "adamw") -> int:
    """The paper's K for ``optimizer`` with parameters of ``param_bytes`` bytes: its float32
    states, plus a 4-byte float32 master, except for float32 parameters, which are their
    own master at every stage. Adam in bf16: 4 + 8 = 12; in float32: 8."""
    return OPTIMIZER_STATE_BYTES[optimizer] + (0 if param_bytes == 4 else 4)


class ModelStateBytes(NamedTuple):
    """Bytes one rank holds, by category."""

    parameters: float
    gradients: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states


def model_state_bytes(
    params: float,
    world_size: int,
    stage: int,
    *,
    optimizer_state_bytes: float = ADAM_STATE_BYTES,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> ModelStateBytes:
    """Per-rank model-state bytes of ``params`` parameters at ``stage`` on ``world_size`` ranks."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if params < 0:
        raise ValueError(f"params must be >= 0, got {params}")
    n = world_size
    return ModelStateBytes(
        parameters=params * param_bytes / (n if stage >= 3 else 1),
        gradients=params * grad_bytes / (n if stage >= 2 else 1),
        optimizer_states=params * optimizer_state_bytes / (n if stage >= 1 else 1),
    )
