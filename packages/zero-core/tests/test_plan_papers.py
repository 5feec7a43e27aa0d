"""The papers' published results against zero-plan's predictions (issue 51, points 4-5).

The bounds are what the model achieves, not goals: with the presets as sourced and one
fitted V100 efficiency, every row but MiCS's is within 35% of its published value (the
worst: ZeRO++'s speed-ups at 400 Gbps and 2K tokens, -27%, and ZeRO-3's bars there, +31%);
MiCS's headline, whose setup the abstract does not give, is 71% under (docs/plan-papers.md
says why; the paper's evaluation section is in no stored source, so MiCS has one row and no
fitted number of its own). A change to the cost model that moves a row past its bound
fails here, naming the row; regenerate the docs table then
(``python -m zero_core.plan.papers``) and refit ``paper_presets.V100_EFFICIENCY``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.plan.paper_presets import (
    GPU_KIND,
    NET_STEP,
    NVLINK_STEP,
    PAPER_PRESETS,
    RING_BASE,
    V100_EFFICIENCY,
    nccl_ring_step_latency,
)
from zero_core.plan.paper_results import OFFLOAD_10B, RESULTS, megatron_flops
from zero_core.plan.papers import MIN_FIT_ROWS, fit_efficiency, predict_row
from zero_core.plan.presets import HARDWARE
from zero_core.plan.validation import fitted_factor, measured_rows
from zero_core.plan.zeropp_gain import (
    Emulated,
    at_rates,
    bandwidth_for_gain,
    check_emulated,
    cluster_workloads,
    emulated_fit,
    flops_for_gain,
    gain,
    measured_gains,
)

BOUND = 0.35  # every row but MiCS's
MICS_BOUND = 0.75

# The emulated cluster's measured table and the calibration docs/plan.md's cluster table and
# docs/plan-papers.md's point-5 answer are computed from (zero-plan --calibrate, 2026-12-07
# 20:29 UTC, load average 1.5): files, so that the check does not depend on today's load and
# the two documents and this test share one fitted factor.
BENCHMARKS = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"
BENCH = json.loads((BENCHMARKS / "cluster.json").read_text())
CALIBRATION = json.loads((BENCHMARKS / "plan-calibration.json").read_text())
FIT: Emulated = emulated_fit(BENCH, CALIBRATION)


def test_every_row_names_its_source_and_a_preset() -> None:
    keys = [r.key for r in RESULTS]
    assert len(keys) == len(set(keys)), "row keys must be unique"
    for r in RESULTS:
        assert r.source, r.key
        assert r.setup.preset in PAPER_PRESETS, r.key
        if r.metric == "speedup":
            assert r.baseline is not None, r.key


@pytest.mark.parametrize(
    "name, params",
    [("ZeRO 100B", 100e9), ("ZeRO 60B", 60e9), ("ZeRO 13B", 13e9), ("ZeRO-Offload 10B", 10e9),
     ("ZeRO++ 18B", 18e9), ("ZeRO++ 49B", 49e9), ("ZeRO++ 91B", 91e9), ("ZeRO++ 138B", 138e9)],
)  # fmt: skip
def test_model_shapes_have_the_papers_sizes(name: str, params: float) -> None:
    model = next(r.model for r in RESULTS if r.model.name == name)
    assert abs(model.params / params - 1) < 0.05, (name, model.params)


def test_megatron_flops_of_the_offload_tutorial() -> None:
    """96 B s L h^2 (1 + s/6h + V/16Lh): 10 x 1024 tokens, 50 x 4096, checkpointing; the
    tutorial's log then reads 8.716e14 / 18.15 s (forward + backward) = 48 TFLOPS."""
    flops = megatron_flops(OFFLOAD_10B, 10, checkpointing=True)
    expected = 96 * 10 * 1024 * 50 * 4096**2 * (1 + 1024 / (6 * 4096) + 50257 / (16 * 50 * 4096))
    assert flops == pytest.approx(expected)
    assert flops == pytest.approx(8.716e14, rel=1e-3)


def test_nccl_ring_latency() -> None:
    """One node: every step over NVLink... but a one-node group never takes inter_latency,
    so the function returns the network step; 24 DGX-2s: NCCL's sum over 383 steps."""
    assert nccl_ring_step_latency(1, 16) == NET_STEP
    n = 24 * 16
    total = RING_BASE + (n - 24) * NVLINK_STEP + 23 * NET_STEP
    assert nccl_ring_step_latency(24, 16) * (n - 1) == pytest.approx(total)
    assert NVLINK_STEP < nccl_ring_step_latency(24, 16) < NET_STEP


def test_papers_presets_are_zero_plan_presets() -> None:
    for name, cluster in PAPER_PRESETS.items():
        assert HARDWARE[name] == cluster


def test_fitted_efficiency_is_the_stored_one() -> None:
    """The presets' V100 efficiency is what fit_efficiency finds (refit after any model
    change and store the new value; the docs table states it)."""
    assert fit_efficiency() == pytest.approx(V100_EFFICIENCY, abs=0.005)


def test_no_efficiency_is_fitted_from_fewer_than_three_rows() -> None:
    """Issue 51, point 4: a fitted efficiency needs >= 3 rows on its hardware (fewer would
    be a tuned match). MiCS's p3dn.24xlarge has one row, a speed-up, so it has no fitted
    number of its own: it shares the V100's, fitted on the ZeRO and ZeRO++ rows."""
    v100_rows = [r for r in RESULTS if r.fit and GPU_KIND[r.setup.preset] == "v100"]
    assert len(v100_rows) >= MIN_FIT_ROWS == 3
    with pytest.raises(ValueError, match="at least 3"):
        fit_efficiency("v100", v100_rows[: MIN_FIT_ROWS - 1])
    mics = [r for r in RESULTS if r.paper == "MiCS"]
    assert mics and not any(r.fit for r in mics)
    assert PAPER_PRESETS["mics-p3dn"].compute_efficiency == V100_EFFICIENCY
    assert GPU_KIND["mics-p3dn"] == "v100"


def test_every_row_within_the_bound() -> None:
    far = {}
    for r in RESULTS:
        p = predict_row(r, V100_EFFICIENCY)
        bound = MICS_BOUND if r.paper == "MiCS" else BOUND
        if not p.within_claim and abs(p.error) > bound:
            far[r.key] = round(p.error, 3)
    assert not far, f"rows past their bound ({BOUND:.0%}, MiCS {MICS_BOUND:.0%}): {far}"
    # the lower-bound rows (ZeRO's "over 38 / 40 TFLOPS", super-linear) hold or nearly
    for r in RESULTS:
        if r.at_least:
            assert predict_row(r, V100_EFFICIENCY).predicted >= r.value * (1 - 0.05), r.key


def test_superlinear_scaling_is_predicted() -> None:
    """ZeRO's 60B from 64 to 400 GPUs: more data parallelism frees memory for a larger
    micro-batch, so the per-GPU throughput rises (the paper's Figure 3)."""
    row = next(r for r in RESULTS if r.key == "zero-60b-superlinear")
    p = predict_row(row, V100_EFFICIENCY)
    assert p.predicted > 1.0
    assert row.baseline is not None
    assert (
        p.micro_batch > predict_row(row._replace(setup=row.baseline), V100_EFFICIENCY).micro_batch
    )


# ----------------------------------------------------------------- point 5: ZeRO++'s gain
def _small_on(rate: str = "1gbit"):  # type: ignore[no-untyped-def]
    workload = cluster_workloads()["small"]
    return workload, FIT.cluster(rate, workload)


def test_point_5_uses_validations_fit() -> None:
    """One emulated cluster, one fitted factor: zeropp_gain's are zero_core.plan.validation's."""
    assert FIT.factor == fitted_factor(measured_rows(BENCH), CALIBRATION)
    assert 0.1 < FIT.factor < 1.0  # the benchmark ran under far more load than the calibration


@settings(max_examples=25, deadline=None)
@given(st.floats(5, 10), st.floats(0.05, 2))
def test_gain_falls_as_bandwidth_rises(log_bw: float, step: float) -> None:
    workload, cluster = _small_on()
    low = gain(workload, at_rates(cluster, bandwidth=10**log_bw))
    high = gain(workload, at_rates(cluster, bandwidth=10 ** (log_bw + step)))
    assert high <= low * (1 + 1e-9)


def test_bandwidth_for_gain_is_the_threshold() -> None:
    workload, cluster = _small_on()
    b = bandwidth_for_gain(workload, cluster, 1.5)
    assert b is not None
    assert gain(workload, at_rates(cluster, bandwidth=b)) >= 1.5
    assert gain(workload, at_rates(cluster, bandwidth=b * 1.01)) < 1.5


def test_more_compute_needs_less_link_to_gain() -> None:
    """A faster rank leaves the link a larger share of the step: the threshold bandwidth
    rises with the compute rate."""
    workload, cluster = _small_on()
    slow = bandwidth_for_gain(workload, at_rates(cluster, flops=cluster.achieved_flops), 1.5)
    fast = bandwidth_for_gain(workload, at_rates(cluster, flops=10 * cluster.achieved_flops), 1.5)
    assert slow is not None and fast is not None and fast > slow


def test_flops_for_gain_answers_the_question() -> None:
    """Issue 16's 1.5x on the emulated links, on the cluster fitted as docs/plan.md's table
    (about 17 GFLOP/s of matmuls per rank): at 100mbit this rate suffices (the model needs
    7-8, measured 1.96x and 3.09x); at 1gbit a rank would need more than 3 times it (the
    model: 4.3x small, 3.5x large; measured about 1.0x); at 40gbit no rate does (latencies
    and coding bound the gain). The 1gbit bound was "more than 10 times" against the
    earlier model and a load-14 calibration without the fitted factor; the model's overlap
    of link waits with the other ranks' compute (more ranks than cores) and the fitted
    factor, which makes the predicted steps the measured ones, moved it."""
    for workload in cluster_workloads().values():
        rates = {}
        for rate in ("100mbit", "1gbit", "40gbit"):
            cluster = FIT.cluster(rate, workload)
            rates[rate] = flops_for_gain(workload, cluster, 1.5)
            f = rates[rate]
            if f is not None:
                assert gain(workload, at_rates(cluster, flops=f)) >= 1.5
                assert gain(workload, at_rates(cluster, flops=f / 1.01)) < 1.5
        achieved = FIT.cluster("1gbit", workload).achieved_flops
        assert rates["100mbit"] is not None and rates["100mbit"] <= achieved
        assert rates["1gbit"] is not None and rates["1gbit"] > 3 * achieved
        assert rates["40gbit"] is None


def test_emulated_cluster_gains_against_measured() -> None:
    """docs/benchmarks/cluster.md's measured speed-ups: the model orders them as measured
    (100mbit > 1gbit >= 40gbit) and is within 30% of each (its worst: large at 100mbit,
    2.40x predicted, 3.09x measured, -22%). Before the emulated cluster was validation's
    fitted one the bound was a factor 2 (predicted 1.50x there)."""
    checks = {(c.model, c.rate): c for c in check_emulated(FIT)}
    assert set(checks) == set(measured_gains(BENCH))
    assert len(checks) == 6
    for model in ("small", "large"):
        g = {rate: checks[model, rate].predicted_gain for rate in ("100mbit", "1gbit", "40gbit")}
        assert g["100mbit"] > g["1gbit"] >= g["40gbit"] - 0.05, (model, g)
    for key, c in checks.items():
        assert abs(c.predicted_gain / c.measured_gain - 1) <= 0.30, (key, c)
