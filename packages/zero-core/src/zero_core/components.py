"""Build an engine's components as its StagePolicy chooses them.

slots --plan_units (sharded parameters)--> fetch unit per slot
      --policy.group_layout-------------> GroupLayout per optimizer group
      --ParamTable.place----------------> each slot's bucket, flat range and pieces
parameters (replicated | sharded; shards in a tier)
masters (separate | aliased to parameters | offloaded tile by tile: offload_build)
      <-- take_initial_state: rank 0's values, one parameter at a time -->
gradients (all-reduced | reduce-scattered from buffers | from hooks)
module hooks (stage 3)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from zero_comm import BlockQuantizer, Communicator
from zero_comm.hierarchy import HybridGroups

from .allreduced_gradients import AllReducedGradients
from .config.zero_config import ZeroConfig
from .fetch_units import plan_units
from .grad_reducer import ScatterReduction
from .group_layout import GroupLayout
from .hybrid_sharding import gradient_reduction
from .init_values import InitValues
from .initial_state import take_initial_state
from .master_weights import MasterWeights
from .offload.build import (
    build_offloaded_masters,
    build_parameter_shards,
    check_space,
    master_plan,
    swap_folder,
)
from .offload.masters import OffloadedMasters
from .param_table import ParamSlot, ParamTable
from .reduce_scattered_gradients import ReduceScatteredGradients
from .replicated_params import ReplicatedParameters
from .sharded_params import ShardedParameters
from .stage_policy import GradientPlacement, MasterPlacement, ParameterPlacement, StagePolicy


class Components(NamedTuple):
    layouts: list[GroupLayout]
    parameters: ReplicatedParameters | ShardedParameters
    gradients: AllReducedGradients | ReduceScatteredGradients
    masters: MasterWeights | OffloadedMasters
    module_hooks: list[Any]


def build_components(
    module: nn.Module,
    slots: ParamTable,
    policy: StagePolicy,
    config: ZeroConfig,
    comm: Communicator,
    dtype: torch.dtype,
    init_values: InitValues | None,
    hybrid: HybridGroups | None = None,
    secondary: Communicator | None = None,
    reduction: ScatterReduction | None = None,
    weight_codec: BlockQuantizer | None = None,
) -> Components:
    """Collective: lay the groups out, then build the components ``policy`` chooses,
    filled with rank 0's initial values one parameter at a time.

    ``comm`` is the data-parallel world. With ``hybrid`` the states are laid out over its
    shard group (``hybrid.shard``, whose ranks hold the slices) and gradients are reduced
    across the replicas too, every micro-step or once per accumulation boundary
    (hybrid_sharding.gradient_reduction); rank 0 of the world still gives the initial values.
    ``secondary``: stage 3's hpZ group (hybrid_sharding.secondary_group), or None.
    ``reduction``: what reduces gradient buckets when not ``comm`` itself (``hybrid``, or
    qgZ's zeropp.QuantizedGradientReduction); ``weight_codec``: qwZ's, or None."""
    world = comm
    comm = comm if hybrid is None else hybrid.shard
    plan = None
    if policy.parameters is ParameterPlacement.SHARDED:
        plan = plan_units(module, slots, config.persistence_threshold)
        for slot in slots:
            slot.unit = plan.slot_units[slot.index]
    layouts = [
        policy.group_layout(
            [slot.numel for slot in group],
            comm.world_size,
            config.bucket_numel,
            units=None if plan is None else [slot.unit or 0 for slot in group],
        )
        for group in slots.by_group
    ]
    shard_rank = comm.rank if policy.shard_optimizer_states else 0
    slots.place(layouts, shard_rank)
    tiles = master_plan(layouts, config)
    check_space(config, tiles, layouts, dtype, world)
    folder = swap_folder(config, world.rank)  # replicas share a shard rank, not a folder
    parameters: ReplicatedParameters | ShardedParameters
    if plan is not None:
        store = build_parameter_shards(layouts, slots, shard_rank, config, comm, dtype, folder)
        parameters = ShardedParameters(
            slots, layouts, plan, dtype, comm, config, store, secondary, weight_codec
        )
    else:
        parameters = ReplicatedParameters(slots, layouts, dtype, comm, config)
    masters: MasterWeights | OffloadedMasters
    if tiles is not None:
        masters = build_offloaded_masters(layouts, slots, shard_rank, config, comm, tiles, folder)
    else:
        aliased = policy.masters(dtype) is MasterPlacement.ALIASED and not config.offloads
        masters = MasterWeights(
            layouts, shard_rank, parameters.owned_slices() if aliased else None, comm.device
        )

    def keep(slot: ParamSlot, value: torch.Tensor) -> None:
        parameters.fill(slot, value)
        masters.fill(slot, value)

    take_initial_state(module, slots, init_values, world, dtype, keep)
    parameters.finish_build()
    masters.finish_fill()
    gradients: AllReducedGradients | ReduceScatteredGradients
    per_micro_step, at_boundary = gradient_reduction(hybrid, config)
    if policy.gradients is GradientPlacement.REPLICATED_VIEWS:
        gradients = AllReducedGradients(slots, layouts, dtype, comm, config)
    else:
        gradients = ReduceScatteredGradients(
            slots,
            layouts,
            dtype,
            comm,
            config,
            full_buffers=policy.gradients is GradientPlacement.REPLICATED_BUCKETS,
            reduce_order=parameters.reduce_order(),
            reduction=reduction if reduction is not None else per_micro_step,
            across_replicas=None if reduction is not None else at_boundary,
        )
        gradients.gradient_listeners.append(parameters.gradient_arrived)
    hooks = [] if policy.module_hooks is None else policy.module_hooks(module, parameters)
    return Components(layouts, parameters, gradients, masters, hooks)


def close_components(
    masters: MasterWeights | OffloadedMasters, parameters: ReplicatedParameters | ShardedParameters
) -> None:
    """Remove swap files and stop I/O threads (an engine's finalizer)."""
    masters.close()
    parameters.close()


def refuse_eager_state_on_disk(
    masters: MasterWeights | OffloadedMasters, optimizer: torch.optim.Optimizer
) -> None:
    """A disk tile's optimizer state must appear at its first step, not at construction."""
    if not isinstance(masters, OffloadedMasters) or masters.swap is None:
        return
    if any(optimizer.state.get(tile) for tile in masters.disk_tiles):
        raise ValueError(
            f"{type(optimizer).__name__} creates its state when it is constructed, so its "
            "state for the disk tier would be made in memory, whole: use offload_optimizer="
            "'cpu', or an optimizer that creates its state at its first step (Adam, AdamW, "
            "SGD, RMSprop)"
        )
