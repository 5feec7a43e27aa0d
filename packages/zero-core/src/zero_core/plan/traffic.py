"""A step's link bytes split by phase, from zero_core.estimate.link_traffic.step_link_bytes
(the formulas tests hold the engine's stats to exactly), never re-derived here.

The phases are those the engine's overlap rules treat apart (plan/step_time.py)::

    forward     stage 3's parameter all-gathers (qwZ: coded), every micro-step
    backward    the gradient reduction (all-reduce, reduce-scatter, qgZ's all-to-alls,
                hybrid sharding's replica sums) and stage 3's backward gathers (hpZ: in its
                group) of the units forward did not keep (the backward head)
    after step  stages 1-2: the all-gather of the updated parameters; every stage > 0: the
                4-byte non-finite flag's all-reduce

Each is a difference of step_link_bytes calls that differ in one input, so the three add
up to step_link_bytes itself:

    backward gathers   = T(kept: the head) - T(kept: every bucket)
    reduction          = (T2(A + 1) - T2(A)) x A        (one micro-step's gradients, A times;
                                                        T2: stage 2's, or stage 1's at 1)
    forward            = T(kept: every bucket) - reduction - flag    (stage 3; flag: T of
                                                                     no bucket)
    after step         = T - reduction - backward gathers - forward

(with a native communicator and hybrid sharding, the replicas' all-reduce runs once per
step and lands in "after step"; it is reduction all the same, and the step-time model
treats it as exposed, as the engine runs it at the accumulation boundary).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ..estimate.link_traffic import backward_head_buckets, even_buckets, step_link_bytes
from .configuration import PlanConfig


class Bytes(NamedTuple):
    """Bytes summed over every rank, by link class."""

    intra: float
    inter: float

    def __add__(self, other: Bytes) -> Bytes:  # type: ignore[override]
        return Bytes(self.intra + other.intra, self.inter + other.inter)

    def __sub__(self, other: Bytes) -> Bytes:
        return Bytes(max(0.0, self.intra - other.intra), max(0.0, self.inter - other.inter))

    def scaled(self, factor: float) -> Bytes:
        return Bytes(self.intra * factor, self.inter * factor)


class PhaseBytes(NamedTuple):
    """One step's bytes by phase (module docstring), summed over ranks."""

    forward: Bytes
    backward_gathers: Bytes
    reduction: Bytes
    after_step: Bytes

    @property
    def total(self) -> Bytes:
        return self.forward + self.backward_gathers + self.reduction + self.after_step


def step_buckets(params: float, config: PlanConfig, world_size: int) -> list[int]:
    """zero-estimate's buckets of a step: Ψ in buckets of ``bucket_numel``, each padded to
    the shard group (zero_core.estimate.link_traffic.even_buckets)."""
    group = config.shard_group if config.stage >= 1 and config.shard_group else world_size
    return even_buckets(int(params), config.bucket_numel, group)


def phase_bytes(
    params: float, config: PlanConfig, *, world_size: int, ranks_per_node: int,
    dtype_bytes: int, reduce_bytes: int, accumulation: int = 1,
) -> PhaseBytes:  # fmt: skip
    """One step's link bytes by phase (module docstring) of ``params`` parameters under
    ``config`` on ``world_size`` ranks in nodes of ``ranks_per_node``."""
    return _phase_bytes(
        int(params), _traffic_key(config), world_size, ranks_per_node, dtype_bytes,
        reduce_bytes, accumulation,
    )  # fmt: skip


def _traffic_key(config: PlanConfig) -> PlanConfig:
    """``config`` with the fields that do not change link bytes set to defaults (a cache key)."""
    return PlanConfig(
        stage=config.stage, shard_group=config.shard_group, hpz=config.hpz,
        quantize_weights=config.quantize_weights, quantize_gradients=config.quantize_gradients,
        bucket_numel=config.bucket_numel, backward_head_numel=config.backward_head_numel,
        keep_backward_head=config.keep_backward_head, deterministic=config.deterministic,
    )  # fmt: skip


@lru_cache(maxsize=4096)
def _phase_bytes(
    params: int, config: PlanConfig, n: int, per_node: int, width: int, grad_width: int, a: int
) -> PhaseBytes:
    if n == 1:
        zero = Bytes(0.0, 0.0)
        return PhaseBytes(zero, zero, zero, zero)
    stage = config.stage
    group = config.shard_group if stage >= 1 else None
    buckets = step_buckets(params, config, n)
    head: list[int] = []
    if stage == 3 and config.keep_backward_head:
        head = backward_head_buckets(buckets, config.backward_head_numel)

    def total(kept: list[int], micro: int, stage: int = stage, held: list[int] = buckets) -> Bytes:
        traffic = step_link_bytes(
            held, world_size=n, ranks_per_node=per_node, stage=stage, dtype_bytes=width,
            reduce_bytes=grad_width, shard_group_size=group,
            hpz_partition_size=config.hpz if stage == 3 else 1,
            quantize_weights=config.quantize_weights and stage == 3,
            quantize_gradients=config.quantize_gradients if stage >= 2 and not group else None,
            accumulation_steps=micro, deterministic=config.deterministic,
            kept_bucket_numels=kept,
        )  # fmt: skip
        return Bytes(float(traffic.intra_node), float(traffic.inter_node))

    whole = total(head, a)
    if stage == 0:
        zero = Bytes(0.0, 0.0)
        return PhaseBytes(zero, zero, whole, zero)
    # Stages 2 and 3 reduce gradients alike; stage 2's gathers do not repeat per micro-step.
    reference = 2 if stage == 3 else stage
    reduction = (total([], a + 1, reference) - total([], a, reference)).scaled(a)
    gathers = Bytes(0.0, 0.0)
    forward = Bytes(0.0, 0.0)
    if stage == 3:
        all_kept = total(buckets, a)
        gathers = whole - all_kept
        forward = all_kept - reduction - total([], a, held=[])  # the flag is after the step
    after = whole - reduction - gathers - forward
    return PhaseBytes(forward, gathers, reduction, after)
