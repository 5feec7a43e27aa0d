"""Typed access to the component a stage chose, for the tools and tests that look inside one.

An engine's components are typed by their contracts (component_contracts); a tool that
reads stage 3's gatherer or the disk tier's swap files narrows the component here, and
gets an error naming what the engine has instead of an AttributeError deep inside:

    gatherer = sharded_parameters(engine).gatherer      # stage 3 only
    folder = disk_swap(engine).folder                   # offload_optimizer="nvme" only
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .offload.masters import OffloadedMasters
from .offload.swapped_tiles import SwappedTiles
from .reduce_scattered_gradients import ReduceScatteredGradients
from .sharded_params import ShardedParameters

if TYPE_CHECKING:
    from .engine import Engine


def sharded_parameters(engine: Engine) -> ShardedParameters:
    """Stage 3's parameters (the compute shards, their gatherer and fetch-unit plan)."""
    parameters = engine.compute_params
    if not isinstance(parameters, ShardedParameters):
        raise TypeError(
            f"this engine (stage {engine.config.stage}) holds {type(parameters).__name__}: "
            "only stage 3 partitions the parameters"
        )
    return parameters


def reduce_scattered_gradients(engine: Engine) -> ReduceScatteredGradients:
    """Stages 1-3's gradients (this rank's reduced slice of every bucket)."""
    gradients = engine.gradients
    if not isinstance(gradients, ReduceScatteredGradients):
        raise TypeError(
            f"this engine (stage {engine.config.stage}) holds {type(gradients).__name__}: "
            "only stages 1-3 reduce-scatter gradients"
        )
    return gradients


def disk_swap(engine: Engine) -> SwappedTiles:
    """The disk tier of the master weights and optimizer states (offload to nvme)."""
    masters = engine.masters
    if not isinstance(masters, OffloadedMasters) or masters.swap is None:
        raise TypeError(
            f"this engine's master weights ({type(masters).__name__}) have no disk tier: "
            "build it with offload_optimizer='nvme' and an offload_dir"
        )
    return masters.swap
