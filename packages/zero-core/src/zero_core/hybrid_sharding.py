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

from zero_comm import Communicator
from zero_comm.hierarchy import HybridGroups

from .config import ZeroConfig


def hybrid_groups(comm: Communicator, config: ZeroConfig) -> HybridGroups | None:
    """Collective: the shard and replica groups ``config.shard_group_size`` asks for, or
    None when the states are sharded over every rank (no size, or the world's size)."""
    _refuse_combinations(config)
    size = config.shard_group_size
    if size is None or size == comm.world_size:
        return None
    if size > comm.world_size or comm.world_size % size:
        valid = [d for d in range(1, comm.world_size + 1) if comm.world_size % d == 0]
        raise ValueError(
            f"shard_group_size={size} does not divide the {comm.world_size} data-parallel "
            f"ranks: use one of {valid}"
        )
    return HybridGroups(comm, size)


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
    shard group (the world without hybrid sharding), or None when hpZ is off."""
    size = config.hpz_partition_size
    if size == 1:
        return None
    base = comm if hybrid is None else hybrid.shard
    if size >= base.world_size or base.world_size % size:
        valid = [d for d in range(2, base.world_size) if base.world_size % d == 0]
        raise ValueError(
            f"hpz_partition_size={size}: hpZ's group must divide the {base.world_size} ranks "
            f"the parameters are sharded over and be smaller (usually the ranks per node): "
            + (f"use one of {valid}, or 1 to turn it off" if valid else "use 1 (off) here")
        )
    return base.split(color=base.rank // size)
