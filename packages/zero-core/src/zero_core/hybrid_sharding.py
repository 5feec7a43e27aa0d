"""Hybrid sharding (MiCS, FSDP's HSDP): which groups an engine's states are laid out over.

    N = R x S ranks:   shard group g = ranks g*S .. g*S+S-1   (states partitioned over S)
                       replica j of a shard rank s = rank j*S + s (states replicated R times)

Per rank, with Psi parameters and K bytes of optimizer state per parameter (mixed
precision Adam: K = 12), the model states are those of flat sharding over S ranks:

    stage 1: 2 Psi + 2 Psi + K Psi / S     stage 2: 2 Psi + (2 + K) Psi / S
    stage 3: (4 + K) Psi / S

and the gradient traffic is a reduce-scatter of the bucket inside the shard group plus,
per rank, one chunk of Psi / S elements across the replicas.

When the replicas are summed. With a deterministic communicator, at every micro-step
(zero_comm.hierarchy's chain): the flat fold adds every rank's micro-step gradient before
the micro-steps are accumulated, and summing each replica's accumulation first would
change the order of the additions, so exactness costs one cross-replica reduction per
micro-step. With a native communicator, as MiCS and HSDP do, once per accumulation
boundary: micro-steps reduce-scatter inside the shard group only, into the accumulated
shard, and ``step()`` all-reduces that shard across the replicas once
(:func:`gradient_reduction`), so A micro-steps cross the nodes once instead of A times.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

from zero_comm import Communicator
from zero_comm.hierarchy import HybridGroups

from .config.zero_config import ZeroConfig


class HierarchySizes(NamedTuple):
    """What ``config``'s hierarchy settings come to on a number of data-parallel ranks."""

    shard_group: int  # ranks the states are partitioned over (all, without hybrid sharding)
    hpz: int  # ranks of hpZ's secondary partition; 1 when off or when it has no effect
    note: str  # "" or the one line to say once: a setting that has no effect here


def hierarchy_sizes(config: ZeroConfig, data_parallel: int) -> HierarchySizes:
    """Check the hierarchy settings against ``data_parallel`` ranks, without any
    communication, so a launcher can refuse them before a rank starts and the engine
    with the same words. Raises ValueError naming the setting and the values that work.

    hpZ over the whole shard group is the primary partition itself (DeepSpeed's ZeRO++
    tutorial sets 8 on one 8-GPU node): it runs, with hpZ off and a note."""
    _refuse_combinations(config)
    size = config.shard_group_size
    group = data_parallel if size is None else size
    if group > data_parallel or data_parallel % group:
        valid = [d for d in range(1, data_parallel + 1) if data_parallel % d == 0]
        raise ValueError(
            f"shard_group_size={size} does not divide the {data_parallel} data-parallel "
            f"ranks: use one of {valid}"
        )
    hpz = config.hpz_partition_size
    if hpz > 1 and (hpz > group or group % hpz):
        valid = [d for d in range(2, group) if group % d == 0]
        raise ValueError(
            f"hpz_partition_size={hpz}: hpZ's group must divide the {group} ranks the "
            "parameters are sharded over (usually the ranks per node): "
            + (f"use one of {valid}, or 1 to turn it off" if valid else "use 1 (off) here")
        )
    if config.quantize_gradients is not None and group < data_parallel:
        raise ValueError(
            "quantize_gradients with shard_group_size: qgZ reduces over every rank by node "
            "groups, hybrid sharding over its shard groups; use one of them"
        )
    note = ""
    if hpz > 1 and hpz == group:
        note = (
            f"hpz_partition_size={hpz} equals the {group} ranks the parameters are sharded "
            "over: hpZ's secondary copy would be the primary partition, so it has no effect "
            "(it helps where the shard group spans nodes: set it to the ranks per node)"
        )
        hpz = 1
    return HierarchySizes(group, hpz, note)


def hybrid_groups(comm: Communicator, config: ZeroConfig) -> HybridGroups | None:
    """Collective: the shard and replica groups ``config.shard_group_size`` asks for, or
    None when the states are sharded over every rank (no size, or the world's size)."""
    sizes = hierarchy_sizes(config, comm.world_size)
    if sizes.shard_group == comm.world_size:
        return None
    return HybridGroups(comm, sizes.shard_group)


def gradient_reduction(
    hybrid: HybridGroups | None, config: ZeroConfig
) -> tuple[HybridGroups | Communicator | None, Communicator | None]:
    """(what reduces a micro-step's buckets, the group that sums the accumulated shards
    at the boundary): ``(hybrid, None)`` when every micro-step reduces across the replicas
    (deterministic, or no accumulation), ``(hybrid.shard, hybrid.replica)`` when the
    replicas are summed once per boundary; ``(None, None)`` without hybrid sharding."""
    if hybrid is None:
        return None, None
    if hybrid.deterministic or config.gradient_accumulation_steps == 1:
        return hybrid, None
    return hybrid.shard, hybrid.replica


def _refuse_combinations(config: ZeroConfig) -> None:
    """Combinations not built: they fail here, by name, instead of training without one."""
    if config.hierarchical_gather and config.quantize_weights:
        raise ValueError(
            "hierarchical_gather with quantize_weights: qwZ's gathers are not hierarchical; "
            "turn one of them off"
        )


def secondary_group(
    comm: Communicator, config: ZeroConfig, hybrid: HybridGroups | None
) -> Communicator | None:
    """Collective: hpZ's group of ``config.hpz_partition_size`` consecutive ranks of the
    shard group (the world without hybrid sharding), or None when hpZ is off or has no
    effect (its size is the shard group's: rank 0 says so once)."""
    sizes = hierarchy_sizes(config, comm.world_size)
    if sizes.note and comm.rank == 0:
        warnings.warn(sizes.note, stacklevel=2)
    if sizes.hpz == 1:
        return None
    base = comm if hybrid is None else hybrid.shard
    return base.split(color=base.rank // sizes.hpz)
