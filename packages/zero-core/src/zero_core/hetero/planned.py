"""What a mixed-hardware step adds to its slots, from the planner's cost model (zero_core.plan).

'auto' measures each rank's time per micro-batch slot t_i directly (forward, backward and
the slot's staging of its gradients). What it does not measure at the run's own counts
comes from the planner's terms (plan/terms.py), on a :class:`~zero_core.plan.Cluster`
(this machine's calibration: plan/presets.this_machine):

    reduction   A x the row reduction of the last slot of each micro-step: the plain
                reduction's link bytes (plan/traffic.phase_bytes, stage 0's all-reduce or
                stages 1-3's reduce-scatter) with each rank's rows padded to
                m = max(1, c_1, ..., c_{N-1}) rows (rank 0 sends its block pre-added as one
                row: zero_core.slot_rows; zero_comm.row_collectives), so m x the bytes of
                a reduce-scatter and (m + 1) / 2 x those of an all-reduce (its all-gather
                half is not padded); its start-up, one collective per bucket per hop;
                exposed as far as the cluster overlaps it with the last slot (terms.exposed)
    optimizer   the gradient passes (non-finite check, clip norm, cast) and the optimizer
                over the largest rank's shard: Ψ (stage 0), else max_i f_i Ψ with f_i the
                shard weights (1/N even)
    after step  stages 1 and 2: the all-gather of the updated parameters; every stage > 0:
                the non-finite flag (phase_bytes' after-step bytes), with their start-up

The predicted step is then A x max_i c_i t_i + reduction + optimizer + after step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ..plan.cluster import Cluster
from ..plan.configuration import PlanConfig
from ..plan.terms import device_optimizer_rate, exposed, gradient_time, latency_time, link_time
from ..plan.traffic import phase_bytes, step_buckets


class PlannedOverhead(NamedTuple):
    """Seconds per step the planner's terms give (module docstring)."""

    reduction_s: float
    optimizer_s: float
    after_step_s: float

    @property
    def total(self) -> float:
        return self.reduction_s + self.optimizer_s + self.after_step_s


def row_padding(counts: Sequence[int]) -> int:
    """m: the rows every rank's part of a row reduction is padded to (rank 0 sends its
    block pre-added as one row; homogeneous counts of 1 use the plain collective)."""
    if all(c == 1 for c in counts):
        return 1
    return max(1, *counts[1:])


def planned_overhead(
    counts: Sequence[int],
    cluster: Cluster,
    *,
    params: int,
    stage: int,
    bucket_numel: int,
    dtype_bytes: int,
    reduce_bytes: int,
    accumulation: int = 1,
    shard_weights: Sequence[float] | None = None,
    slot_seconds: float = 0.0,
) -> PlannedOverhead:
    """The planner's seconds per step for what 'auto' does not measure, for N =
    len(counts) ranks on one node of ``cluster``, Ψ = ``params`` parameters in
    ``dtype_bytes`` (gradients reduced in ``reduce_bytes``), ``accumulation`` micro-steps
    a step, and the last slot's ``slot_seconds`` of compute for the reduction to hide
    behind (as far as ``cluster.overlap`` lets it)."""
    ranks = len(counts)
    if ranks < 1 or min(counts) < 1:
        raise ValueError(f"counts {tuple(counts)}: give one count >= 1 per rank")
    config = PlanConfig(stage=stage, bucket_numel=bucket_numel)
    phases = phase_bytes(
        params, config, world_size=ranks, ranks_per_node=ranks,
        dtype_bytes=dtype_bytes, reduce_bytes=reduce_bytes, accumulation=accumulation,
    )  # fmt: skip
    m = row_padding(counts)
    padded = m if stage > 0 else (m + 1) / 2
    buckets = len(step_buckets(params, config, ranks)) if ranks > 1 else 0
    comm = link_time(phases.reduction.scaled(padded), cluster, ranks)
    comm += latency_time(buckets * accumulation * (1 if stage > 0 else 2), ranks, cluster, False)
    reduction = exposed(comm, slot_seconds * accumulation, max(buckets, 1), cluster.overlap)
    if stage == 0 or shard_weights is None:
        share = 1.0 if stage == 0 else 1.0 / ranks
    else:
        share = max(shard_weights) / math.fsum(shard_weights)
    shard = params * share
    optimizer = shard / device_optimizer_rate(cluster)
    optimizer += gradient_time(shard, reduce_bytes, cluster)
    after = 0.0
    if stage > 0 and ranks > 1:
        gathers = buckets if stage in (1, 2) else 0
        after = link_time(phases.after_step, cluster, ranks)
        after += latency_time(gathers + 1, ranks, cluster, False)
    return PlannedOverhead(reduction, optimizer, after)
