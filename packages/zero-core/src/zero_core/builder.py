"""Build everything an Engine runs, in one place, as its StagePolicy and config choose.

build_engine_parts(module, groups, config, comm, policy) -> EngineParts, collective:

    loss scaler     float16: dynamic or static; else none
    slots           ParamTable: one ParamSlot per trainable parameter
    groups of ranks hybrid sharding's shard/replica groups, hpZ's secondary group
    codecs          ZeRO++: qgZ reduces gradient buckets, qwZ codes stage 3's gathers
    components      (build_components below, typed by component_contracts)
    optimizer       the user's optimizer class over the master tiles
    fused step      optimizer_in_backward: a BackwardStepper, wired to the bucket reducer

The engine receives the parts and wires nothing itself. Components, in build order:

slots --plan_units (sharded parameters)--> fetch unit per slot
      --policy.group_layout-------------> GroupLayout per optimizer group
      --ParamTable.place----------------> each slot's bucket, flat range and pieces
parameters (replicated | sharded; shards in a tier)
masters (separate | aliased to parameters | offloaded tile by tile: offload_build)
      <-- take_initial_state: rank 0's values, one parameter at a time -->
gradients (all-reduced | reduce-scattered from buffers | from hooks; slices following
      the offloaded masters' tiers: offload.gradient_tier)
module hooks (stage 3)
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from zero_comm import BlockQuantizer, Communicator
from zero_comm.hierarchy import HybridGroups

from .allreduced_gradients import AllReducedGradients
from .component_contracts import GradientComponent, MasterComponent, ParameterComponent
from .config.zero_config import ZeroConfig
from .fetch_units import plan_units
from .grad_reducer import ScatterReduction
from .group_layout import GroupLayout
from .hybrid_sharding import gradient_reduction, hybrid_groups, secondary_group
from .init_values import InitValues
from .initial_state import take_initial_state
from .loss_scaler import LossScaler, NoLossScaler
from .master_weights import MasterWeights
from .model_parallel import ModelParallel
from .offload.build import (
    build_offloaded_masters,
    build_parameter_shards,
    check_space,
    master_plan,
    swap_folder,
)
from .offload.masters import OffloadedMasters
from .optimizer_in_backward import BackwardStepper
from .optimizer_spec import ParamGroups
from .param_table import ParamSlot, ParamTable
from .reduce_scattered_gradients import ReduceScatteredGradients
from .replicated_params import ReplicatedParameters
from .sharded_params import ShardedParameters
from .slot_rows import SlotRows, unsupported_with_slots
from .stage_policy import GradientPlacement, MasterPlacement, ParameterPlacement, StagePolicy
from .uneven_shards import UnevenShardComm, uneven_weights
from .virtual_ranks import VirtualRanks
from .zeropp import gradient_quantization, weight_quantizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an Engine runs, built and wired (build_engine_parts); see engine.py for
    how each is used. ``shard_comm``: the ranks the states are partitioned over (``comm``,
    or hybrid sharding's shard group); ``secondary``: stage 3's hpZ group, or None."""

    module: nn.Module
    config: ZeroConfig
    comm: Communicator
    policy: StagePolicy
    model_parallel: ModelParallel | None
    loss_scaler: LossScaler | NoLossScaler
    slots: ParamTable
    hybrid: HybridGroups | None
    shard_comm: Communicator
    secondary: Communicator | None
    layouts: list[GroupLayout]
    parameters: ParameterComponent
    gradients: GradientComponent
    masters: MasterComponent
    module_hooks: list[Any]
    optimizer: torch.optim.Optimizer
    backward_stepper: BackwardStepper | None
    virtual_ranks: VirtualRanks
    slot_rows: SlotRows  # the gradient collectives' rows when a rank runs several slots


def build_engine_parts(
    module: nn.Module,
    groups: ParamGroups,
    config: ZeroConfig,
    comm: Communicator,
    policy: StagePolicy,
    model_parallel: ModelParallel | None = None,
    init_values: InitValues | None = None,
) -> EngineParts:
    """Collective over ``comm`` (the data-parallel world): every part, in the order above."""
    # First, before any collective: every rank refuses a setting that does not fit alike.
    virtual = VirtualRanks.for_world(config.micro_batches_per_rank, comm.world_size, comm.rank)
    refused = None if virtual.homogeneous_run else unsupported_with_slots(config, comm.world_size)
    if refused:
        raise ValueError(f"[rank {comm.rank}] {refused}")
    if not virtual.homogeneous_run and not comm.deterministic and comm.rank == 0:
        # Slots' rows are then folded in the backend's order: a valid step of V
        # micro-batches, but not the V-rank run's bits, which is what counts promise.
        warnings.warn(
            f"micro_batches_per_rank={list(virtual.counts)} on a communicator with "
            "deterministic=False: the run trains, but equals the homogeneous run at "
            f"{virtual.total} ranks only to within rounding; create it with "
            "zero_comm.init(..., deterministic=True) for the same bits",
            stacklevel=3,
        )
    slot_rows = SlotRows(virtual, comm)
    dtype = config.param_dtype
    split = model_parallel.sharded if model_parallel is not None else ()
    slots = ParamTable(module, groups.params, split)
    hybrid = hybrid_groups(comm, config)  # states over a shard group, replicated across
    secondary = secondary_group(comm, config, hybrid)  # hpZ: backward gathers in one node
    components = build_components(
        module, slots, policy, config, comm, dtype, init_values, hybrid, secondary,
        gradient_quantization(comm, config), weight_quantizer(config),
        slot_rows if slot_rows.active else None,
    )  # fmt: skip
    masters = components.masters
    if isinstance(components.parameters, ShardedParameters) and len(set(virtual.counts)) > 1:
        # Stage 3, ranks with different slot counts: each micro-step's units stay gathered
        # from its first forward to this rank's last backward (param_gatherer: pinned).
        components.parameters.gatherer.pin_slots = virtual.count
    optimizer = groups.build([[tile for tile, _ in tiles] for tiles in masters.tiles])
    refuse_eager_state_on_disk(masters, optimizer)
    stepper = None
    if config.optimizer_in_backward:  # ZeroConfig allows it only where these hold
        gradients, fused_masters = components.gradients, components.masters
        assert isinstance(gradients, ReduceScatteredGradients)
        assert isinstance(fused_masters, MasterWeights)
        stepper = BackwardStepper(
            comm, config, gradients, fused_masters, optimizer,
            components.parameters.take_master_values, model_parallel,
        )  # fmt: skip
        gradients.reducer.on_reduced = stepper.bucket_reduced  # each bucket, as it lands
    log.debug(
        "rank %d: stage %d, %s parameters, %s gradients, %s masters, %s%s",
        comm.rank, config.stage, type(components.parameters).__name__,
        type(components.gradients).__name__, type(masters).__name__, type(optimizer).__name__,
        ", optimizer in backward" if stepper is not None else "",
    )  # fmt: skip
    return EngineParts(
        module=module,
        config=config,
        comm=comm,
        policy=policy,
        model_parallel=model_parallel,
        loss_scaler=loss_scaler(config),
        slots=slots,
        hybrid=hybrid,
        shard_comm=components.shard_comm,
        secondary=secondary,
        layouts=components.layouts,
        parameters=components.parameters,
        gradients=components.gradients,
        masters=masters,
        module_hooks=components.module_hooks,
        optimizer=optimizer,
        backward_stepper=stepper,
        virtual_ranks=virtual,
        slot_rows=slot_rows,
    )


def loss_scaler(config: ZeroConfig) -> LossScaler | NoLossScaler:
    """float16's loss scaler as configured (a fixed ``loss_scale``, or dynamic when it is
    0); other dtypes need none."""
    if config.param_dtype is not torch.float16:
        return NoLossScaler()
    return LossScaler(
        config.loss_scale or config.initial_loss_scale,
        dynamic=config.loss_scale == 0,
        window=config.loss_scale_window,
        hysteresis=config.hysteresis,
        minimum=config.min_loss_scale,
    )


class Components(NamedTuple):
    layouts: list[GroupLayout]
    parameters: ParameterComponent
    gradients: GradientComponent
    masters: MasterComponent
    module_hooks: list[Any]
    shard_comm: Communicator  # the ranks the states are partitioned over (uneven: wrapped)


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
    slot_rows: SlotRows | None = None,
) -> Components:
    """Collective: lay the groups out, then build the components ``policy`` chooses,
    filled with rank 0's initial values one parameter at a time.

    ``comm`` is the data-parallel world. With ``hybrid`` the states are laid out over its
    shard group (``hybrid.shard``, whose ranks hold the slices) and gradients are reduced
    across the replicas too, every micro-step or once per accumulation boundary
    (hybrid_sharding.gradient_reduction); rank 0 of the world still gives the initial values.
    ``secondary``: stage 3's hpZ group (hybrid_sharding.secondary_group), or None.
    ``reduction``: what reduces gradient buckets when not ``comm`` itself (``hybrid``, or
    qgZ's zeropp.QuantizedGradientReduction); ``weight_codec``: qwZ's, or None.
    ``slot_rows``: the rows of several micro-batch slots per rank (zero_core.slot_rows),
    which then reduce every gradient bucket; None with one slot per rank."""
    world = comm
    comm = comm if hybrid is None else hybrid.shard
    weights = uneven_weights(config, comm) if policy.shard_optimizer_states else None
    if weights is not None:  # issue 52: uneven shards (zero_core.uneven_shards)
        uneven = UnevenShardComm(comm, weights)
        comm = cast(Communicator, uneven)
        if slot_rows is not None:  # and virtual ranks: the rows go on the wire as it lays them
            slot_rows.uneven = uneven
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
            weights=weights,
            rank=comm.rank,
        )
        for group in slots.by_group
    ]
    shard_rank = comm.rank if policy.shard_optimizer_states else 0
    slots.place(layouts, shard_rank)
    tiles = master_plan(layouts, config)
    check_space(config, tiles, layouts, dtype, world)
    log.debug(
        "rank %d: %d groups, %d buckets, %d elements per rank's shard, bucket_numel %d",
        world.rank, len(layouts), sum(len(lay.buckets) for lay in layouts),
        sum(lay.shard_numel for lay in layouts), config.bucket_numel,
    )  # fmt: skip
    folder = swap_folder(config, world.rank)  # replicas share a shard rank, not a folder
    parameters: ReplicatedParameters | ShardedParameters  # concrete: owned_slices below
    if plan is not None:
        store = build_parameter_shards(layouts, slots, shard_rank, config, comm, dtype, folder)
        parameters = ShardedParameters(
            slots, layouts, plan, dtype, comm, config, store, secondary, weight_codec
        )
    else:
        parameters = ReplicatedParameters(slots, layouts, dtype, comm, config)
    masters: MasterComponent
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
    gradients: GradientComponent
    per_micro_step, at_boundary = gradient_reduction(hybrid, config)
    reduce_dtype = config.gradient_dtype  # the compute dtype unless config.reduce_dtype
    if policy.gradients is GradientPlacement.REPLICATED_VIEWS:
        gradients = AllReducedGradients(slots, layouts, reduce_dtype, comm, config, slot_rows)
    else:
        scattered = ReduceScatteredGradients(
            slots,
            layouts,
            reduce_dtype,
            comm,
            config,
            full_buffers=policy.gradients is GradientPlacement.REPLICATED_BUCKETS,
            reduce_order=parameters.reduce_order(),
            reduction=reduction if reduction is not None else per_micro_step,
            across_replicas=None if reduction is not None else at_boundary,
            offloaded_masters=masters if isinstance(masters, OffloadedMasters) else None,
            slot_rows=slot_rows,
        )
        scattered.gradient_listeners.append(parameters.gradient_arrived)
        gradients = scattered
    hooks = [] if policy.module_hooks is None else policy.module_hooks(module, parameters)
    return Components(layouts, parameters, gradients, masters, hooks, comm)


def close_components(
    masters: MasterComponent, parameters: ParameterComponent, delayed: Any = None
) -> None:
    """Remove swap files and stop I/O threads (an engine's finalizer), once a delayed
    update in flight (``delayed``, zero_core.delayed_update) has finished with them."""
    if delayed is not None:
        delayed.close()
    masters.close()
    parameters.close()


def refuse_eager_state_on_disk(masters: MasterComponent, optimizer: torch.optim.Optimizer) -> None:
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
