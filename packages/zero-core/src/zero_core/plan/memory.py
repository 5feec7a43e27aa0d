"""Memory of one rank under a configuration, all from zero_core.estimate: model states by
tier (model_states.tiered_state_bytes, with gradient offload), activations
(activations.activation_bytes) and the working set (working_set.working_bytes: gradient
buckets, the autograd gradient, stage 3's gathered units and coalesced gathers).

    device   model states on the device + the activations' peak + the working set
             (+ hpZ's secondary partition, p Ψ / P, as zero-estimate counts it)
    host     offloaded model states + the disk pipeline's staging + the read-ahead
    disk     offloaded model states in swap files

All per rank; a node holds devices_per_node of each host and disk figure.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..estimate.activations import CheckpointMode, activation_bytes
from ..estimate.model_states import tiered_state_bytes
from ..estimate.working_set import transformer_largest, working_bytes
from .configuration import PlanConfig
from .workload import Workload

MAX_LIVE_NUMEL = 2**28  # ZeroConfig.max_live_numel's default


class MemoryBytes(NamedTuple):
    """Bytes one rank holds at its peak, by place (module docstring)."""

    device: float
    host: float
    disk: float
    model_states_device: float
    activations: float
    working_set: float


def shard_ranks(config: PlanConfig, world_size: int) -> int:
    """Ranks the model states are sharded over: the shard group (hybrid), else N."""
    return config.shard_group if config.stage >= 1 and config.shard_group else world_size


def memory_bytes(
    workload: Workload, config: PlanConfig, world_size: int, tp: int = 1
) -> MemoryBytes:
    """One rank's peak bytes on the device, in host memory and on disk."""
    n = shard_ranks(config, world_size)
    p, g = workload.dtype_bytes, workload.grad_bytes
    largest_param, largest_unit = transformer_largest(workload.vocab_size, workload.width, tp)
    states = tiered_state_bytes(
        workload.params, n, config.stage,
        optimizer_state_bytes=workload.optimizer_state_bytes + (0 if p == 4 else 4),
        param_bytes=p, grad_bytes=g, offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params, sub_group_numel=config.offload_sub_group_numel,
        buffer_count=config.offload_buffer_count, bucket_numel=config.bucket_numel,
        largest_param_numel=largest_param, prefetch_numel=config.prefetch_numel,
        offload_gradients=config.offload_gradients,
    )  # fmt: skip
    # A bucket holds at most the model's parameters (the engine sizes its pool to it).
    bucket = min(config.bucket_numel, max(1, math.ceil(workload.params)))
    working = working_bytes(
        config.stage, n, param_bytes=p, grad_bytes=g, bucket_numel=bucket,
        max_buckets_in_flight=config.max_buckets_in_flight, largest_param_numel=largest_param,
        largest_unit_numel=largest_unit, prefetch_numel=config.prefetch_numel,
        max_live_numel=MAX_LIVE_NUMEL, backward_head_numel=config.kept_head_numel,
        gather_coalesce_numel=config.gather_coalesce_numel,
    ).total  # fmt: skip
    if config.stage == 3 and config.hpz > 1:
        working += p * workload.params / config.hpz
    checkpoint: CheckpointMode = "none"
    if config.checkpoint != "none":
        checkpoint = "partitioned" if config.checkpoint == "partitioned" and tp > 1 else "full"
    acts = activation_bytes(
        workload.shape(world_size), tp=tp, checkpoint=checkpoint, dtype_bytes=p
    ).peak
    return MemoryBytes(
        device=states.device + acts + working,
        host=states.host_resident + states.read_ahead,
        disk=states.disk,
        model_states_device=states.device,
        activations=acts,
        working_set=working,
    )
