"""Memory of one rank under a configuration: model states by tier
(zero_core.estimate.model_states.tiered_state_bytes), activations
(zero_core.estimate.activations.activation_bytes) and the working set.

    device   model states on the device + the activations' peak + the working set
    host     offloaded model states + the disk pipeline's staging + read-ahead (per rank;
             the node holds devices_per_node of them)
    disk     offloaded model states in swap files (per rank)

Working set (the engine's bounded buffers):

    gradient buckets   max_buckets_in_flight x min(bucket_numel, Ψ) x g    (stages 0-3)
    gathered units     stage 3: min(Ψ, prefetch_numel + head + one bucket) x p, the
                       units gathered at once at backward's start (prefetch window,
                       backward head and the unit in use)
    hpZ secondary      stage 3 with hpZ: p Ψ / P

Gradient offload (``offload_gradients`` with an optimizer tier): the gradient shard
g Ψ/N (stages 2-3; stages 0-1 keep the full gradient to reduce it) leaves the device for
the tier, in float32 there (accumulated in float32, 4 bytes per element).
"""

from __future__ import annotations

from typing import NamedTuple

from ..estimate.activations import CheckpointMode, activation_bytes
from ..estimate.model_states import tiered_state_bytes
from .configuration import PlanConfig
from .workload import Workload


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
    largest = workload.vocab_size * workload.width / tp  # the embedding
    states = tiered_state_bytes(
        workload.params, n, config.stage,
        optimizer_state_bytes=workload.optimizer_state_bytes + (0 if p == 4 else 4),
        param_bytes=p, grad_bytes=g, offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params, sub_group_numel=config.offload_sub_group_numel,
        buffer_count=config.offload_buffer_count, bucket_numel=config.bucket_numel,
        largest_param_numel=largest, prefetch_numel=config.prefetch_numel,
    )  # fmt: skip
    device_states, host, disk = states.device, states.host_resident + states.read_ahead, states.disk
    if config.offload_gradients and config.offload_optimizer != "none" and config.stage >= 2:
        device_states -= states.gradients
        shard = workload.params / n * 4
        if config.offload_optimizer == "cpu":
            host += shard
        else:
            disk += shard
    checkpoint: CheckpointMode = "none"
    if config.checkpoint != "none":
        checkpoint = "partitioned" if config.checkpoint == "partitioned" and tp > 1 else "full"
    acts = activation_bytes(
        workload.shape(world_size), tp=tp, checkpoint=checkpoint, dtype_bytes=p
    ).peak
    bucket = min(config.bucket_numel, workload.params)
    working = config.max_buckets_in_flight * bucket * g
    if config.stage == 3:
        live = config.prefetch_numel + config.kept_head_numel + max(bucket, largest)
        working += min(workload.params, live) * p
        if config.hpz > 1:
            working += p * workload.params / config.hpz
    return MemoryBytes(
        device=device_states + acts + working, host=host, disk=disk,
        model_states_device=device_states, activations=acts, working_set=working,
    )  # fmt: skip
