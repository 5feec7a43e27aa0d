"""One ZeRO configuration a plan considers: ZeroConfig's fields that change a step's
time, memory or traffic, and activation checkpointing (zero-train's --checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..config.choices import offload_stage_error
from ..config.zero_config import (
    DEFAULT_BACKWARD_HEAD_NUMEL,
    DEFAULT_GATHER_COALESCE_NUMEL,
    DEFAULT_PREFETCH_NUMEL,
)

TIERS = ("none", "cpu", "disk")


@dataclass(frozen=True)
class PlanConfig:
    """The fields keep ZeroConfig's names and defaults; ``checkpoint`` is the blocks'
    activation checkpointing ("none", "full"; "partitioned" counts as "full" without
    tensor parallelism), ``shard_group`` None for no hybrid sharding."""

    stage: int = 3
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_gradients: bool = True
    delayed_parameter_update: bool = False
    shard_group: int | None = None
    hpz: int = 1
    quantize_weights: bool = False
    quantize_gradients: str | None = None
    checkpoint: str = "none"
    bucket_numel: int = 2**22
    prefetch_numel: int = DEFAULT_PREFETCH_NUMEL
    backward_head_numel: int = DEFAULT_BACKWARD_HEAD_NUMEL
    keep_backward_head: bool = True
    gather_coalesce_numel: int = DEFAULT_GATHER_COALESCE_NUMEL
    max_buckets_in_flight: int = 2
    offload_sub_group_numel: int = 2**22
    offload_buffer_count: int = 4
    deterministic: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"PlanConfig.stage={self.stage}: ZeRO stages are 0-3")
        for key in ("offload_optimizer", "offload_params"):
            if getattr(self, key) not in TIERS:
                raise ValueError(f"PlanConfig.{key}={getattr(self, key)!r}: one of {TIERS}")
        problem = offload_stage_error(self.stage, self.offload_optimizer, self.offload_params)
        if problem:
            raise ValueError(problem)
        if self.checkpoint not in ("none", "full", "partitioned"):
            raise ValueError(f"PlanConfig.checkpoint={self.checkpoint!r}: none, full, partitioned")
        if self.quantize_gradients not in (None, "int4", "int8"):
            raise ValueError(
                f"PlanConfig.quantize_gradients={self.quantize_gradients!r}: None, int4, int8"
            )
        if self.stage < 3 and (self.hpz > 1 or self.quantize_weights):
            raise ValueError("hpZ and qwZ are stage 3's (ZeRO++ gathers parameters at stage 3)")
        if self.stage < 2 and self.quantize_gradients:
            raise ValueError("qgZ needs stage 2 or 3 (it reduce-scatters gradients)")
        if self.delayed_parameter_update and self.offload_optimizer == "none":
            raise ValueError("delayed_parameter_update needs offload_optimizer 'cpu' or 'disk'")

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def kept_head_numel(self) -> int:
        """Elements past backward's first unit forward keeps for it (0: none kept)."""
        return self.backward_head_numel if self.keep_backward_head else 0

    def label(self) -> str:
        """A short name: 'stage 3, optimizer disk, params disk, hpZ 8, qwZ, qgZ int4'."""
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer != "none":
            grads = "" if self.offload_gradients else " (gradients on device)"
            parts.append(f"optimizer {self.offload_optimizer}{grads}")
        if self.offload_params != "none":
            parts.append(f"params {self.offload_params}")
        if self.delayed_parameter_update:
            parts.append("DPU")
        if self.shard_group:
            parts.append(f"shard group {self.shard_group}")
        if self.hpz > 1:
            parts.append(f"hpZ {self.hpz}")
        if self.quantize_weights:
            parts.append("qwZ")
        if self.quantize_gradients:
            parts.append(f"qgZ {self.quantize_gradients}")
        if self.checkpoint != "none":
            parts.append(f"checkpoint {self.checkpoint}")
        if self.bucket_numel != 2**22:
            parts.append(f"bucket 2^{self.bucket_numel.bit_length() - 1}")
        if self.stage == 3 and self.prefetch_numel != DEFAULT_PREFETCH_NUMEL:
            parts.append(f"prefetch 2^{max(self.prefetch_numel, 1).bit_length() - 1}")
        return ", ".join(parts)

    def with_(self, **changes: Any) -> PlanConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
