"""Build an engine's components as its StagePolicy chooses them.

slots --plan_units (sharded parameters)--> fetch unit per slot
      --policy.group_layout-------------> GroupLayout per optimizer group
      --ParamTable.place----------------> each slot's bucket, flat range and pieces
parameters (replicated | sharded)      masters (separate | aliased to parameters)
      <-- take_initial_state: rank 0's values, one parameter at a time -->
gradients (all-reduced | reduce-scattered from buffers | from hooks)
module hooks (stage 3)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from zero_comm import Communicator

from .allreduced_gradients import AllReducedGradients
from .config import ZeroConfig
from .fetch_units import plan_units
from .group_layout import GroupLayout
from .init_values import InitValues
from .initial_state import take_initial_state
from .master_weights import MasterWeights
from .param_table import ParamSlot, ParamTable
from .reduce_scattered_gradients import ReduceScatteredGradients
from .replicated_params import ReplicatedParameters
from .sharded_params import ShardedParameters
from .stage_policy import GradientPlacement, MasterPlacement, ParameterPlacement, StagePolicy


class Components(NamedTuple):
    layouts: list[GroupLayout]
    parameters: ReplicatedParameters | ShardedParameters
    gradients: AllReducedGradients | ReduceScatteredGradients
    masters: MasterWeights
    module_hooks: list[Any]


def build_components(
    module: nn.Module,
    slots: ParamTable,
    policy: StagePolicy,
    config: ZeroConfig,
    comm: Communicator,
    dtype: torch.dtype,
    init_values: InitValues | None,
) -> Components:
    """Collective: lay the groups out, then build the components ``policy`` chooses,
    filled with rank 0's initial values one parameter at a time."""
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
    parameters: ReplicatedParameters | ShardedParameters
    if plan is not None:
        parameters = ShardedParameters(slots, layouts, plan, dtype, comm, config)
    else:
        parameters = ReplicatedParameters(slots, layouts, dtype, comm, config)
    aliased = policy.masters(dtype) is MasterPlacement.ALIASED
    masters = MasterWeights(
        layouts, shard_rank, parameters.owned_slices() if aliased else None, comm.device
    )

    def keep(slot: ParamSlot, value: torch.Tensor) -> None:
        parameters.fill(slot, value)
        masters.fill(slot, value)

    take_initial_state(module, slots, init_values, comm, dtype, keep)
    parameters.finish_build()
    gradients: AllReducedGradients | ReduceScatteredGradients
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
        )
        gradients.gradient_listeners.append(parameters.gradient_arrived)
    hooks = [] if policy.module_hooks is None else policy.module_hooks(module, parameters)
    return Components(layouts, parameters, gradients, masters, hooks)
