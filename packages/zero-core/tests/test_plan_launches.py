"""zero_core.plan's fixed costs: the launch count (plan/launches.py), the terms that charge
the engine's per-launch, per-unit and per-step costs (plan/terms.py), their calibration
through the real engine (plan/calibrate_engine.py) and this machine's preset reading it.

That the counts equal what the engine launches for zero-train's GPTs is
packages/zero-models/tests/test_plan_accuracy.py's test_launches_are_the_engines (it
builds zero_models' GPT, which zero-core's tests may not import).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import Communicator, run_simulated
from zero_core.plan import Cluster, PlanConfig, Workload, predict, workload_from_gpt
from zero_core.plan.calibrate_engine import UNITS, measure_engine_overheads
from zero_core.plan.launches import count_launches
from zero_core.plan.presets import this_machine

CALIBRATION = {
    "measured_at": "test", "cpu_count": 2, "ranks": 2, "load_average": [0.0, 0.0, 0.0],
    "matmul_flops": {"128": 4e10}, "op_overhead": 5e-6, "memory_bandwidth": 1e10,
    "optimizer_rate": 2e8, "gloo": {"latency_s": 2e-4, "bandwidth": 1e9},
}  # fmt: skip


def cpu_cluster(**changes: float) -> Cluster:
    return this_machine(CALIBRATION, ranks=2, width=128).with_(**changes)


@settings(max_examples=30, deadline=None)
@given(
    stage=st.sampled_from([0, 1, 2, 3]),
    accumulation=st.integers(1, 3),
    bucket=st.sampled_from([2**14, 2**16, 2**22]),
    cost=st.floats(1e-5, 1e-2),
)
def test_each_launch_costs_launch_overhead_on_the_critical_path(
    stage: int, accumulation: int, bucket: int, cost: float
) -> None:
    """launch_time is not hidden: a step grows by launch_overhead x every launch of it
    (plan/launches.py's count, A micro-steps of gathers and reductions, and the step's)."""
    workload = workload_from_gpt("small", accumulation=accumulation)
    config = PlanConfig(stage=stage, bucket_numel=bucket)
    base = predict(workload, cpu_cluster(), config).step_s
    charged = predict(workload, cpu_cluster(launch_overhead=cost), config).step_s
    launches = count_launches(workload, config, 2).per_step(accumulation)
    assert launches > 0
    assert charged - base == pytest.approx(cost * launches, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_overhead_is_paid_once_per_step(stage: int) -> None:
    workload = workload_from_gpt("small", accumulation=2)
    config = PlanConfig(stage=stage)
    base = predict(workload, cpu_cluster(), config).step_s
    charged = predict(workload, cpu_cluster(step_overhead=0.015), config)
    assert charged.step_s - base == pytest.approx(0.015)
    assert charged.terms["step_overhead"] == 0.015


def test_unit_overhead_is_per_unit_pass_at_stage_3_only() -> None:
    """units x 2 passes x A x unit_overhead; stages 0-2 have no fetch units."""
    workload = workload_from_gpt("small", accumulation=3)
    small, large = cpu_cluster(unit_overhead=1e-4), cpu_cluster(unit_overhead=3e-4)
    units = count_launches(workload, PlanConfig(stage=3), 2).units
    assert units == 4 * 4 + 2  # 4 per block (qkv, proj, fc, proj), wte, wpe
    grown = (
        predict(workload, large, PlanConfig(stage=3)).step_s
        - predict(workload, small, PlanConfig(stage=3)).step_s
    )
    assert grown == pytest.approx(units * 2 * 3 * 2e-4)
    for stage in (0, 1, 2):
        assert predict(workload, large, PlanConfig(stage=stage)).terms["units"] == 0.0


def test_launches_follow_the_layout_not_the_parameter_count() -> None:
    """Smaller buckets mean more reductions; no coalescing and no prefetch mean a gather per
    unit; one rank launches nothing."""
    workload = workload_from_gpt("small")
    default = count_launches(workload, PlanConfig(stage=3), 2)
    assert (default.forward_gathers, default.reductions) == (5, 13)
    small_buckets = count_launches(workload, PlanConfig(stage=3, bucket_numel=2**14), 2)
    assert small_buckets.reductions > default.reductions
    alone = count_launches(
        workload, PlanConfig(stage=3, gather_coalesce_numel=0, prefetch_numel=0), 2
    )
    assert alone.forward_gathers == alone.units
    assert count_launches(workload, PlanConfig(stage=3), 1).per_step(1) == 0
    big = Workload(params=1.3e9, layers=24, width=2048, heads=16, vocab_size=50257, context=1024)
    assert count_launches(big, PlanConfig(stage=2), 64).reductions >= 1


def test_this_machine_takes_the_engine_costs_and_shares_the_cores() -> None:
    """The calibration's engine costs become the cluster's; where ranks outnumber the cores
    they take longer by the share (as op_overhead does); an older calibration without them
    charges none."""
    engine = {"launch_overhead": 1e-4, "unit_overhead": 2e-4, "step_overhead": 3e-3}
    calibration = {**CALIBRATION, "engine": engine}
    two = this_machine(calibration, ranks=2, width=128)
    assert (two.launch_overhead, two.unit_overhead, two.step_overhead) == (1e-4, 2e-4, 3e-3)
    four = this_machine(calibration, ranks=4, width=128)
    assert four.step_overhead == pytest.approx(6e-3)
    old = this_machine(CALIBRATION, ranks=2, width=128)
    assert (old.launch_overhead, old.unit_overhead, old.step_overhead) == (0.0, 0.0, 0.0)


def test_engine_overheads_measure_the_engine_on_two_ranks() -> None:
    """measure_engine_overheads on a simulated world: the launches are the engine's (stage 0
    one all-reduce; stage 3 more, and more again with nothing coalesced) and every cost is
    a time >= 0."""
    results: list[dict[str, float]] = []

    def body(comm: Communicator) -> None:
        measured = measure_engine_overheads(comm, hop=0.0, rounds=2)
        if comm.rank == 0:
            results.append(measured)

    run_simulated(2, body)
    (measured,) = results
    assert measured["launches_a"] == measured["launches_b"] == 1
    assert measured["launches_b"] < measured["launches_c"] < measured["launches_d"]
    assert measured["launches_d"] >= 2 * UNITS  # a gather and a reduction per unit at least
    for key in ("per_launch_s", "launch_overhead", "unit_overhead", "step_overhead"):
        assert measured[key] >= 0.0, key
    assert measured["launch_overhead"] == measured["per_launch_s"]  # hop 0: nothing charged
