"""zero_core.plan: the cost model's parts, its command, and its agreement with
zero_core.estimate (the byte counts are estimate's, not a second copy).

The local accuracy against zero-train is packages/zero-models/tests/test_plan_accuracy.py
(it runs zero-train, which zero-core's tests may not import).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.estimate.activations import activation_bytes
from zero_core.estimate.command import main as estimate_main
from zero_core.estimate.link_traffic import backward_head_buckets, step_link_bytes
from zero_core.estimate.model_states import tiered_state_bytes
from zero_core.plan import (
    Cluster,
    PlanConfig,
    Workload,
    candidates,
    memory_bytes,
    parse_quantity,
    plan,
    predict,
    terms,
    workload_from_gpt,
    workload_from_hf_config,
)
from zero_core.plan.command import main as plan_main
from zero_core.plan.presets import emulated_cluster, preset, this_machine
from zero_core.plan.traffic import phase_bytes, step_buckets

CALIBRATION = {
    "measured_at": "test", "cpu_count": 2, "ranks": 2, "load_average": [0.0, 0.0, 0.0],
    "matmul_flops": {"64": 2e10, "128": 4e10, "256": 6e10}, "op_overhead": 5e-6,
    "memory_bandwidth": 1e10, "optimizer_rate": 2e8,
    "gloo": {"latency_s": 2e-4, "bandwidth": 1e9},
}  # fmt: skip


def gpu_cluster(**changes: object) -> Cluster:
    """An illustrative 8-GPU-node cluster (not a preset)."""
    base = Cluster(
        name="test-gpus", nodes=4, devices_per_node=8, device_memory=80e9, peak_flops=300e12,
        compute_efficiency=0.5, memory_bandwidth=2e12, intra_bandwidth=150e9,
        intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6, host_memory=1e12,
        host_bandwidth=25e9, host_optimizer_rate=1e9, disk_bandwidth=5e9,
    )  # fmt: skip
    return base.with_(**changes)


def gpt(**changes: object) -> Workload:
    return Workload(params=1.3e9, layers=24, width=2048, heads=16, vocab_size=50257,
                    context=1024, batch_size=128, dtype="bf16").with_(**changes)  # fmt: skip


# --- link bytes: estimate's, split by phase ------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    stage=st.sampled_from([0, 1, 2, 3]),
    nodes=st.sampled_from([1, 2, 4]),
    per_node=st.sampled_from([1, 2, 4]),
    params=st.integers(10_000, 3_000_000),
    bucket=st.sampled_from([2**14, 2**16, 2**20]),
    hierarchy=st.sampled_from(["flat", "hybrid", "hpz", "qwz", "qgz", "zero++"]),
    accumulation=st.integers(1, 3),
    head=st.sampled_from([0, 2**15, 2**24]),
)
def test_phases_add_up_to_estimates_step_bytes(
    stage: int, nodes: int, per_node: int, params: int, bucket: int, hierarchy: str,
    accumulation: int, head: int,
) -> None:  # fmt: skip
    """Whatever the options, the phases sum to zero_core.estimate's step_link_bytes (the
    figure the engine's stats are held to), and none is negative."""
    n = nodes * per_node
    options: dict[str, object] = {
        "flat": {}, "hybrid": {"shard_group": per_node}, "hpz": {"hpz": per_node},
        "qwz": {"quantize_weights": True}, "qgz": {"quantize_gradients": "int4"},
        "zero++": {"hpz": per_node, "quantize_weights": True, "quantize_gradients": "int4"},
    }[hierarchy]  # fmt: skip
    try:
        config = PlanConfig(stage=stage, bucket_numel=bucket, backward_head_numel=head,
                            **options)  # type: ignore[arg-type]  # fmt: skip
    except ValueError:
        return  # a combination the engine refuses (hpZ at stage 2, ...)
    if config.hpz == 1 and "hpz" in options and per_node > 1:
        return
    if (config.shard_group or 0) == n or (config.hpz > 1 and config.hpz == n):
        return  # hierarchy_sizes runs these as flat
    phases = phase_bytes(params, config, world_size=n, ranks_per_node=per_node,
                         dtype_bytes=2, reduce_bytes=4, accumulation=accumulation)  # fmt: skip
    buckets = step_buckets(params, config, n)
    kept = backward_head_buckets(buckets, head) if stage == 3 else []
    whole = step_link_bytes(
        buckets, world_size=n, ranks_per_node=per_node, stage=stage, dtype_bytes=2,
        reduce_bytes=4, shard_group_size=config.shard_group if stage else None,
        hpz_partition_size=config.hpz, quantize_weights=config.quantize_weights,
        quantize_gradients=config.quantize_gradients if not config.shard_group else None,
        accumulation_steps=accumulation, kept_bucket_numels=kept,
    ) if n > 1 else None  # fmt: skip
    for phase in phases:
        assert phase.intra >= 0 and phase.inter >= 0
    total = phases.total
    if whole is None:
        assert total.intra == total.inter == 0
        return
    assert math.isclose(total.intra, float(whole.intra_node), rel_tol=1e-9, abs_tol=1e-6)
    assert math.isclose(total.inter, float(whole.inter_node), rel_tol=1e-9, abs_tol=1e-6)


def test_phases_of_stage3_and_stage2() -> None:
    """Stage 3 flat without a backward head: forward gathers Ψ, backward gathers Ψ and
    reduces Ψ (each (N-1)/N per rank, float32 here); stage 2: reduce, then the publish."""
    n, psi = 4, 2**20
    three = phase_bytes(psi, PlanConfig(stage=3, keep_backward_head=False), world_size=n,
                        ranks_per_node=n, dtype_bytes=4, reduce_bytes=4)  # fmt: skip
    ring = psi * 4 * (n - 1)  # bytes summed over the ranks of one ring collective of Ψ
    assert three.forward.intra == three.backward_gathers.intra == ring
    assert three.reduction.intra == pytest.approx(ring + 4 * (n - 1), abs=64)  # + the flag
    two = phase_bytes(psi, PlanConfig(stage=2), world_size=n, ranks_per_node=n,
                      dtype_bytes=4, reduce_bytes=4)  # fmt: skip
    assert two.forward.intra == two.backward_gathers.intra == 0
    assert two.reduction.intra == ring and two.after_step.intra == pytest.approx(ring, abs=64)


# --- memory: estimate's formulas -------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_is_estimates_plus_working_set(stage: int) -> None:
    """Without offload, device = tiered_state_bytes' device + activation_bytes' peak + the
    working set; the model states part is estimate's to the byte."""
    w = gpt()
    config = PlanConfig(stage=stage)
    m = memory_bytes(w, config, 32)
    states = tiered_state_bytes(
        w.params,
        32,
        stage,
        optimizer_state_bytes=12,
        param_bytes=2,
        grad_bytes=2,
        largest_param_numel=w.vocab_size * w.width,
    )
    acts = activation_bytes(w.shape(32), dtype_bytes=2)
    assert m.model_states_device == states.device
    assert m.activations == acts.peak
    assert m.device == pytest.approx(states.device + acts.peak + m.working_set)
    assert m.host == m.disk == 0


def test_gradient_offload_moves_the_gradient_shard() -> None:
    """With the optimizer's tier and offload_gradients, stage 2 keeps at most one landed
    bucket slice of its gradient shard g Ψ/N on the device (estimate's rule); without
    offload_gradients all of it."""
    w = gpt()
    on = memory_bytes(w, PlanConfig(stage=2, offload_optimizer="cpu"), 8)
    kept = PlanConfig(stage=2, offload_optimizer="cpu", offload_gradients=False)
    off = memory_bytes(w, kept, 8)
    moved = off.model_states_device - on.model_states_device
    largest_slice = max(2**22, w.vocab_size * w.width) / 8  # the embedding's bucket
    assert 2 * (w.params / 8 - largest_slice) <= moved <= 2 * w.params / 8
    assert on.host > off.host


# --- terms and rules -----------------------------------------------------------------


def test_flops_formula() -> None:
    assert terms.model_flops(1e9, 1000, 10, 100, 50) == 6e12 + 12 * 10 * 50 * 100 * 1000
    recomputed = terms.model_flops(1e9, 1000, 10, 100, 50, recompute=True)
    assert recomputed == 8e12 + 16 * 10 * 50 * 100 * 1000


@given(comm=st.floats(0, 10), compute=st.floats(0, 10), pieces=st.integers(1, 50),
       overlap=st.floats(0, 1))  # fmt: skip
def test_exposed_is_between_the_last_piece_and_all(
    comm: float, compute: float, pieces: int, overlap: float
) -> None:
    left = terms.exposed(comm, compute, pieces, overlap)
    assert comm / pieces - 1e-12 <= left <= comm + 1e-12 or comm == 0
    if overlap == 0:
        assert left == comm


def test_link_time_takes_the_slower_link_class() -> None:
    c = gpu_cluster()
    # 32 ranks, 4 nodes: 3.2e9 intra bytes in all = 1e8 per rank; 2e9 inter = 5e8 per node.
    from zero_core.plan.traffic import Bytes

    t = terms.link_time(Bytes(3.2e9, 2e9), c, 32)
    assert t == max(1e8 / 150e9, 5e8 / 50e9)


def test_zeropp_is_faster_than_flat_on_a_slow_network_and_moves_less() -> None:
    w = gpt()
    slow = gpu_cluster(inter_bandwidth=12.5e9 / 8)  # 12.5 Gbit/s per node
    flat = predict(w, slow, PlanConfig(stage=3))
    zpp = predict(w, slow, PlanConfig(stage=3, hpz=8, quantize_weights=True,
                                      quantize_gradients="int4"))  # fmt: skip
    assert zpp.inter_node_bytes < 0.5 * flat.inter_node_bytes
    assert zpp.step_s < flat.step_s
    fast = gpu_cluster(inter_bandwidth=400e9)
    assert predict(w, fast, PlanConfig(stage=3)).step_s < flat.step_s


def test_dpu_hides_the_host_step_only_where_work_overlaps() -> None:
    w = gpt(params=1e9, layers=16)
    one = gpu_cluster(nodes=1)
    sync = predict(w, one, PlanConfig(stage=2, offload_optimizer="cpu"))
    dpu = predict(w, one, PlanConfig(stage=2, offload_optimizer="cpu",
                                     delayed_parameter_update=True))  # fmt: skip
    assert dpu.step_s < sync.step_s
    cpu = one.with_(overlap=0.0)
    assert predict(w, cpu, dpu.config).step_s == pytest.approx(predict(w, cpu, sync.config).step_s)


def test_a_model_too_large_for_the_device_fits_only_offloaded() -> None:
    """13B in fp16 on one 32 GB GPU (ZeRO-Offload's headline): not without offload;
    stage 2 with the optimizer (and gradients) on the host, yes."""
    v100 = gpu_cluster(nodes=1, devices_per_node=1, device_memory=32e9, host_memory=1.5e12)
    w = gpt(params=13e9, layers=40, width=5120, heads=40, batch_size=8, context=512,
            dtype="fp16")  # fmt: skip
    assert not predict(w, v100, PlanConfig(stage=0)).fits
    offloaded = predict(w, v100, PlanConfig(stage=2, offload_optimizer="cpu", checkpoint="full"))
    assert offloaded.fits, offloaded.memory
    best = plan(w, v100, PlanConfig(stage=3)).ranked[0]
    assert best.fits and best.config.offload_optimizer != "none"


def test_candidates_cover_the_options_and_are_valid() -> None:
    configs = candidates(gpu_cluster())
    assert {c.stage for c in configs} == {0, 1, 2, 3}
    assert any(c.hpz > 1 and c.quantize_weights and c.quantize_gradients for c in configs)
    assert any(c.shard_group for c in configs)
    assert any(c.offload_params == "disk" for c in configs)
    assert any(c.checkpoint == "full" for c in configs)
    assert len(set(configs)) == len(configs)
    single = candidates(gpu_cluster(nodes=1))
    assert not any(c.hpz > 1 or c.shard_group for c in single)


# --- cluster, workload, presets ------------------------------------------------------


def test_quantities_and_cluster_json(tmp_path: Path) -> None:
    assert parse_quantity("100Gbit/s") == 12.5e9
    assert parse_quantity("25GB/s") == 25e9
    assert parse_quantity("32GiB") == 32 * 2**30
    assert parse_quantity("125TFLOP/s") == 125e12
    with pytest.raises(ValueError, match="with a unit"):
        parse_quantity("fast")
    c = gpu_cluster()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c.to_json()))
    assert Cluster.load(path) == c
    path.write_text(json.dumps({"nodes": 2, "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        Cluster.load(path, base=c)
    with pytest.raises(ValueError, match="inter_bandwidth"):
        c.with_(inter_bandwidth=0)


def test_hugging_face_config(tmp_path: Path) -> None:
    """GPT-2's config.json gives zero-train's gpt2 parameter count."""
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 12,
                "n_embd": 768,
                "n_head": 12,
                "vocab_size": 50257,
                "n_positions": 1024,
            }
        )
    )
    assert workload_from_hf_config(path).params == workload_from_gpt("gpt2").params


def test_presets_from_a_calibration() -> None:
    here = this_machine(CALIBRATION, ranks=2, width=128)
    assert here.achieved_flops == 4e10 and here.overlap == 0
    # 4 ranks on 2 cores: each gets half the rate the 2 calibrating processes had.
    emulated = emulated_cluster(CALIBRATION, "100mbit", 128)
    assert emulated.world_size == 4 and emulated.achieved_flops == 2e10
    # A rank waiting on the link leaves its half of a core to the others.
    assert emulated.overlap == 0.5
    assert emulated.inter_bandwidth == pytest.approx(95.3e6 / 8)
    with pytest.raises(ValueError, match="presets are"):
        preset("no-such-cluster", CALIBRATION)


# --- the command ---------------------------------------------------------------------


def run_plan(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    monkeypatch.setenv("ZERO_PLAN_CALIBRATION", str(path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(argv)
    return out.getvalue()


def test_json_has_the_requested_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """zero-train's options (and its step-free ones, ignored) give the requested row."""
    text = run_plan(["--stage", "3", "--steps", "50", "--out", "x", "--json"], monkeypatch,
                    tmp_path)  # fmt: skip
    data = json.loads(text)
    for key in ("fits", "step_s", "tokens_per_s", "device_bytes", "host_bytes", "disk_bytes",
                "intra_node_bytes", "inter_node_bytes"):  # fmt: skip
        assert key in data["requested"], key
    assert data["requested"]["config"]["stage"] == 3
    assert data["ranked"] and data["ranked"][0]["fits"]
    assert data["requested"]["intra_node_bytes"] > 0


@pytest.mark.parametrize(
    "flags",
    [["--micro-batches-per-rank", "2,1"], ["--shard-weights", "2,1"],
     ["--micro-batches-per-rank", "auto", "--virtual-ranks", "12"],
     ["--emulate-micro-batch-seconds", "0.2,0.4"]],
)  # fmt: skip
def test_uneven_rank_options_are_refused_not_ignored(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Mixed ranks change the step, and the plan has one device kind: planning the even
    run instead would answer for another run, so zero-plan stops and names where mixed
    ranks are predicted (zero-train's auto)."""
    with pytest.raises(SystemExit) as exit_info:
        run_plan([*flags, "--json"], monkeypatch, tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err and "--micro-batches-per-rank auto" in err


def test_cluster_flags_and_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(gpu_cluster().to_json()))
    text = run_plan(["--params", "7.5e9", "--layers", "32", "--width", "4096", "--batch-size",
                     "64", "--dtype", "bf16", "--cluster", str(path), "--nodes", "8",
                     "--inter-bandwidth", "100Gbit/s"], monkeypatch, tmp_path)  # fmt: skip
    assert "8 node(s) x 8 device(s)" in text
    assert "why:" in text and "ranked" in text


def test_memory_only_is_zero_estimates_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """zero-plan --memory-only prints zero-estimate's table for the same run (the
    equivalent zero-estimate command on stderr)."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    monkeypatch.setenv("ZERO_PLAN_CALIBRATION", str(path))
    plan_main(["--memory-only", "--stage", "3", "--offload-optimizer", "disk"])
    captured = capsys.readouterr()
    argv = captured.err.strip().splitlines()[-1].split("zero-estimate ", 1)[1].split()
    estimate_main(argv)
    assert capsys.readouterr().out == captured.out


def test_bad_options_end_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        run_plan(["--params", "1e9"], monkeypatch, tmp_path)
    with pytest.raises(SystemExit):
        run_plan(["--cluster", "nowhere"], monkeypatch, tmp_path)


def test_zero_trains_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--config (zero-train's JSON of option values) sets the run; flags override it."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"stage": 1, "steps": 9, "batch_size": 8, "overwrite": True}))
    data = json.loads(run_plan(["--config", str(config), "--json"], monkeypatch, tmp_path))
    assert data["requested"]["config"]["stage"] == 1 and data["workload"]["batch_size"] == 8
    data = json.loads(
        run_plan(["--config", str(config), "--stage", "2", "--json"], monkeypatch, tmp_path)
    )
    assert data["requested"]["config"]["stage"] == 2
