"""What a ZeRO stage is: a frozen choice of where gradients, parameters and master weights
live. The engine builds its components from it and never asks which stage it runs.

    stage   gradients            parameters    optimizer states + masters
    0       replicated views     replicated    replicated (layout of one rank)
    1       replicated buckets   replicated    sharded
    2       sharded              replicated    sharded
    3       sharded              sharded       sharded

Master weights are *separate* float32 tensors, or *aliased* to the compute parameters'
own storage when those are float32 (one copy of the weights instead of two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from .group_layout import GroupLayout


class GradientPlacement(Enum):
    REPLICATED_VIEWS = "replicated views"  # p.grad views of a flat buffer, all-reduced
    REPLICATED_BUCKETS = "replicated buckets"  # p.grad views of buckets, reduce-scattered
    SHARDED = "sharded"  # hooks stage gradients into buckets, reduce-scattered, freed


class ParameterPlacement(Enum):
    REPLICATED = "replicated"  # whole on every rank, views of bucket buffers
    SHARDED = "sharded"  # this rank's shard; gathered unit by unit while used


class MasterPlacement(Enum):
    SEPARATE = "separate"  # float32 tensors of their own
    ALIASED = "aliased"  # the float32 compute parameters' own storage


# Installs stage 3's module hooks on the model for a sharded-parameters component; returns
# the hook handles (kept so that they live as long as the engine).
ModuleHooks = Callable[[nn.Module, Any], list[Any]]


@dataclass(frozen=True)
class StagePolicy:
    """One stage's choices; see the module docstring."""

    name: str
    gradients: GradientPlacement
    parameters: ParameterPlacement
    shard_optimizer_states: bool
    module_hooks: ModuleHooks | None = None

    def masters(self, dtype: torch.dtype) -> MasterPlacement:
        """Float32 compute parameters are their own master weights."""
        return MasterPlacement.ALIASED if dtype == torch.float32 else MasterPlacement.SEPARATE

    def group_layout(
        self,
        numels: list[int],
        world_size: int,
        bucket_numel: int,
        units: list[int] | None = None,
        weights: tuple[float, ...] | None = None,
        rank: int = 0,
    ) -> GroupLayout:
        """The layout of one optimizer group: whole on one rank when nothing is sharded;
        else buckets of about ``bucket_numel`` elements over ``world_size`` ranks, each
        within one fetch unit when ``units`` (one per parameter) are given; ``weights``:
        uneven shards (zero_core.uneven_shards), described for ``rank``."""
        if not self.shard_optimizer_states:
            return GroupLayout.whole(numels)
        return GroupLayout.build(
            numels, world_size, bucket_numel, tags=units, weights=weights, rank=rank
        )
