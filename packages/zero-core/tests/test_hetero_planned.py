"""zero_core.hetero.planned: the once-per-step terms 'auto' takes from the planner. The row
reduction costs the plain reduction's link time times the rows each rank is padded to
(rank 0's block pre-added), the optimizer runs over the largest shard, and the terms are
the planner's own functions on the same cluster."""

from __future__ import annotations

import pytest

from zero_core.hetero.planned import planned_overhead, row_padding
from zero_core.plan import Cluster, PlanConfig
from zero_core.plan.terms import device_optimizer_rate, gradient_time, link_time
from zero_core.plan.traffic import phase_bytes

CLUSTER = Cluster(
    name="test", nodes=1, devices_per_node=2, device_memory=1e9, peak_flops=1e12,
    compute_efficiency=1.0, memory_bandwidth=1e10, intra_bandwidth=1e9, intra_latency=0.0,
    inter_bandwidth=1e9, inter_latency=0.0, host_memory=1e10, host_bandwidth=1e10,
    host_optimizer_rate=1e8, disk_bandwidth=1e9, optimizer_rate=1e8, overlap=0.0,
)  # fmt: skip
PARAMS = 842_496  # zero-train's default GPT


def overhead(counts: tuple[int, ...], stage: int = 2, **kw: object) -> tuple[float, float, float]:
    kwargs: dict = dict(params=PARAMS, stage=stage, bucket_numel=1 << 20, dtype_bytes=4,
                        reduce_bytes=4) | kw  # fmt: skip
    return tuple(planned_overhead(counts, CLUSTER, **kwargs))  # type: ignore[return-value]


def test_rows_are_padded_to_the_largest_block_but_rank_0s() -> None:
    assert row_padding((1, 1)) == 1
    assert row_padding((8, 4)) == 4
    assert row_padding((6, 6)) == 6
    assert row_padding((1, 3, 2)) == 3
    assert row_padding((2, 2)) == 2  # equal counts above 1 still send rows


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_reduction_is_the_plain_ones_link_time_times_the_rows(stage: int) -> None:
    plain = phase_bytes(PARAMS, PlanConfig(stage=stage, bucket_numel=1 << 20), world_size=2,
                        ranks_per_node=2, dtype_bytes=4, reduce_bytes=4).reduction  # fmt: skip
    assert plain.intra > 0
    homogeneous = overhead((1, 1), stage)[0]
    assert homogeneous == pytest.approx(link_time(plain, CLUSTER, 2))
    assert overhead((8, 4), stage)[0] == pytest.approx(4 * homogeneous)
    assert overhead((6, 6), stage)[0] == pytest.approx(6 * homogeneous)
    assert overhead((4, 2), stage, accumulation=3)[0] == pytest.approx(3 * 2 * homogeneous)


def test_stage_0_pads_only_the_reduce_scatter_half_of_the_all_reduce() -> None:
    homogeneous = overhead((1, 1), 0)[0]
    assert overhead((8, 4), 0)[0] == pytest.approx((4 + 1) / 2 * homogeneous)


def test_the_optimizer_steps_the_largest_shard() -> None:
    rate = device_optimizer_rate(CLUSTER)

    def expected(shard: float) -> float:
        return shard / rate + gradient_time(shard, 4, CLUSTER)

    assert overhead((2, 1), 0)[1] == pytest.approx(expected(PARAMS))
    assert overhead((2, 1), 2)[1] == pytest.approx(expected(PARAMS / 2))
    weighted = overhead((2, 1), 2, shard_weights=(2.0, 1.0))[1]
    assert weighted == pytest.approx(expected(PARAMS * 2 / 3))


def test_stages_1_and_2_gather_after_the_step_and_stage_3_does_not() -> None:
    assert overhead((2, 1), 0)[2] == 0.0
    assert overhead((2, 1), 2)[2] > 0
    assert overhead((2, 1), 3)[2] < overhead((2, 1), 2)[2]  # the flag alone


def test_overlap_hides_the_reduction_behind_the_last_slot() -> None:
    busy = CLUSTER.with_(overlap=1.0)
    kwargs: dict = dict(params=PARAMS, stage=2, bucket_numel=1 << 16, dtype_bytes=4,
                        reduce_bytes=4)  # fmt: skip
    exposed = planned_overhead((8, 4), CLUSTER, **kwargs).reduction_s
    hidden = planned_overhead((8, 4), busy, slot_seconds=10.0, **kwargs).reduction_s
    assert 0 < hidden < exposed


def test_wrong_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="one count >= 1 per rank"):
        overhead((2, 0))
