"""The memory formulas against the paper's Figure 1, and their structure as properties; the
offload tiers' placement of the same bytes (measured against an engine in
test_offload_memory.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_core import model_state_bytes
from zero_core.config.zero_config import DEFAULT_PREFETCH_NUMEL
from zero_core.estimate.activations import (
    TransformerShape,
    activation_bytes,
    paper_activation_elements,
)
from zero_core.estimate.command import main
from zero_core.estimate.model_states import SLICE_ALIGNMENT, TIERS, tiered_state_bytes
from zero_core.grad_norm import BLOCK


def test_paper_figure_1() -> None:
    """Ψ = 7.5e9, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB, rounded as the paper does."""
    totals = [round(model_state_bytes(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]
    assert totals == [120.0, 31.4, 16.6, 1.9]


@given(st.integers(0, 10**12), st.integers(1, 4096), st.floats(0, 32))
def test_stages_never_hold_more_and_agree_at_one_rank(params: int, n: int, k: float) -> None:
    totals = [model_state_bytes(params, n, s, optimizer_state_bytes=k).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    single = [model_state_bytes(params, 1, s, optimizer_state_bytes=k).total for s in range(4)]
    assert single == [single[0]] * 4
    # (2 + 2 + K) Ψ summed term by term may round differently from (4 + K) * Ψ.
    assert single[0] == pytest.approx((4 + k) * params, rel=1e-12)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stage": 4}, "stage"), ({"world_size": 0}, "world_size"), ({"params": -1}, "params"),
])  # fmt: skip
def test_bad_input_is_named(kwargs: dict[str, int], message: str) -> None:
    args = {"params": 10, "world_size": 2, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        model_state_bytes(args["params"], args["world_size"], args["stage"])


def test_cli_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.estimate.command", "--params", "7.5e9",
         "--world-size", "64", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert round(json.loads(out)["2"]["total"] / 1e9, 1) == 16.6


def test_cli_dtype_and_optimizer_set_the_bytes_per_parameter() -> None:
    """fp32 SGD with momentum: 4 + 4 bytes of parameters and gradients, K = 4 (the
    momentum; fp32 parameters are their own master weights at every stage)."""
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.estimate.command", "--params", "1000", "--world-size",
         "4", "--dtype", "fp32", "--optimizer", "sgd-momentum", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    totals = {stage: row["total"] for stage, row in json.loads(out).items()}
    assert totals == {"0": 12000, "1": 8000 + 1000, "2": 4000 + 2000, "3": 3000}


def test_activation_estimate_checkpoints_and_partitions() -> None:
    """Without checkpointing a block keeps n (4C + 12C/p) elements plus n (4 + H/p) float32
    statistics; checkpointing keeps n C, P_a n C / p; the paper's rule is 12 n C L."""
    shape = TransformerShape(layers=12, width=768, heads=12, vocab_size=50257, tokens=1024)
    none = activation_bytes(shape, checkpoint="none", dtype_bytes=2)
    full = activation_bytes(shape, checkpoint="full", dtype_bytes=2)
    p_a = activation_bytes(shape, tp=4, checkpoint="partitioned", dtype_bytes=2)
    assert none.kept == 12 * 1024 * (16 * 768 * 2 + (4 + 12) * 4)
    assert full.kept == 12 * 1024 * 768 * 2
    assert p_a.kept == full.kept / 4
    assert paper_activation_elements(shape) == 12 * 768 * 1024 * 12
    assert none.peak > none.kept and full.peak < none.peak and p_a.peak < full.peak
    with pytest.raises(ValueError, match="checkpoint mode"):
        activation_bytes(shape, checkpoint="some")  # type: ignore[arg-type]


def test_zero_estimate_adds_activations_to_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--params", "124e6", "--world-size", "4", "--layers", "12", "--width", "768",
          "--heads", "12", "--vocab-size", "50257", "--tokens", "1024", "--json"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    for stage, row in rows.items():  # + the bounded buffers: none at stages 0 and 1
        assert row["device_peak"] == row["total"] + row["working"]
        assert row["step_peak"] == row["device_peak"] + row["activations_peak"] > row["total"]
        assert (row["working"] > 0) == (stage in "23")
    with pytest.raises(SystemExit):
        main(["--params", "1e6", "--world-size", "2", "--layers", "3"])
    assert "give all of --layers" in capsys.readouterr().err


@st.composite
def tier_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Arguments of tiered_state_bytes: any model, stage 1-3, tiers the stage allows."""
    stage = draw(st.integers(1, 3))
    width = draw(st.sampled_from([2, 4]))  # bf16/fp16 or float32 parameters and gradients
    return {
        "params": draw(st.integers(0, 10**12)),
        "world_size": draw(st.integers(1, 4096)),
        "stage": stage,
        "optimizer_state_bytes": draw(st.sampled_from([0, 4, 8])) + (4 if width == 2 else 0),
        "param_bytes": width,
        "grad_bytes": width,
        "offload_optimizer": draw(st.sampled_from(TIERS)),
        "offload_params": draw(st.sampled_from(TIERS)) if stage == 3 else "none",
        "offload_fraction": draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        "sub_group_numel": draw(st.sampled_from([1, 1000, 2**22])),
        "buffer_count": draw(st.integers(3, 8)),
        "bucket_numel": draw(st.sampled_from([128, 2**20, 2**22])),
        "prefetch_numel": draw(st.sampled_from([0, 2**16, 2**24])),
        "offload_gradients": draw(st.booleans()),
    }


@given(st.integers(0, 10**12), st.integers(1, 4096), st.integers(0, 3), st.sampled_from([2, 4]),
       st.floats(0, 32))  # fmt: skip
def test_without_tiers_everything_is_on_the_device(
    params: int, n: int, stage: int, width: int, k: float
) -> None:
    """No offload: the paper's formula, all on the device, for any K; separate masters (4
    bytes of K) apart from the states, aliased ones (float32 parameters) inside the
    parameters; a K too small for a master is kept whole."""
    plain = model_state_bytes(params, n, stage, optimizer_state_bytes=k, param_bytes=width,
                              grad_bytes=width)  # fmt: skip
    tiered = tiered_state_bytes(params, n, stage, optimizer_state_bytes=k, param_bytes=width,
                                grad_bytes=width)  # fmt: skip
    assert (tiered.host, tiered.disk, tiered.staging) == (0, 0, 0)
    assert (tiered.parameters, tiered.gradients) == (plain.parameters, plain.gradients)
    assert tiered.master_weights + tiered.optimizer_states == pytest.approx(
        plain.optimizer_states, rel=1e-12
    )
    separate = width == 2 and k >= 4
    assert tiered.master_weights == (
        pytest.approx(4 * params / (n if stage else 1)) if separate else 0
    )
    assert tiered.device == pytest.approx(plain.total, rel=1e-12)


@given(tier_cases())
def test_tiers_move_the_bytes_and_add_only_a_separate_master(case: dict[str, Any]) -> None:
    """device + host + disk is the paper's total, plus 4 S where float32 parameters lose
    their aliased master to a separate one (any tier); a fraction f of the masters and
    states (S elements of 4 + s bytes) leaves the device for the tier; host and disk hold
    nothing of a tier not asked for. At stages 2 and 3 with ``offload_gradients`` the
    gradient slice of those elements (g bytes each) goes with them, and the device keeps
    one reduction's landed slice of them (a bucket slice at most) for its copy out."""
    tiered = tiered_state_bytes(**case)
    sizes = ("optimizer_state_bytes", "param_bytes", "grad_bytes")
    plain = model_state_bytes(
        case["params"], case["world_size"], case["stage"], **{k: case[k] for k in sizes}
    )
    shard = case["params"] / case["world_size"]
    offloads = case["offload_optimizer"] != "none" or case["offload_params"] != "none"
    separate = 4 * shard if case["param_bytes"] == 4 and offloads else 0
    follow = case["offload_gradients"] and case["offload_optimizer"] != "none"
    follow = follow and case["stage"] >= 2
    elements = shard * case["offload_fraction"] if case["offload_optimizer"] != "none" else 0
    bucket_slice = math.ceil(case["bucket_numel"] / (case["world_size"] * SLICE_ALIGNMENT))
    landed = case["grad_bytes"] * min(elements, bucket_slice * SLICE_ALIGNMENT) if follow else 0
    assert tiered.model_states == pytest.approx(plain.total + separate + landed, rel=1e-9)
    assert tiered.gradients == pytest.approx(
        plain.gradients - (case["grad_bytes"] * elements if follow else 0) + landed,
        rel=1e-9,
        abs=1e-6,
    )
    g = case["grad_bytes"]
    assert tiered.tier_gradients == (pytest.approx(g * elements) if follow else 0)
    moved = 0.0
    if case["offload_optimizer"] != "none":
        states = case["optimizer_state_bytes"] - (0 if case["param_bytes"] == 4 else 4)
        moved = (4 + states + (g if follow else 0)) * elements
    if case["offload_params"] != "none":
        assert tiered.parameters == 0
    for tier, held in (("cpu", tiered.host), ("disk", tiered.disk)):
        expected = moved if case["offload_optimizer"] == tier else 0.0
        expected += plain.parameters if case["offload_params"] == tier else 0.0
        assert held == pytest.approx(expected, rel=1e-9, abs=1e-6)
    # Staging: the optimizer's pipeline (B tiles of 4 + s bytes per element, at most what
    # is on disk), the parameters' read buffers (at most the shard, at least one slice).
    pipeline = case["buffer_count"] * case["sub_group_numel"] * (4 + 8 + 4)
    reads = plain.parameters if case["offload_params"] == "disk" else 0.0
    assert tiered.staging <= pipeline + 1e-6 * tiered.staging
    assert tiered.read_ahead <= reads + 1e-6 * tiered.read_ahead
    disk_optimizer = case["offload_optimizer"] == "disk" and moved > 0
    assert (tiered.staging > 0) == disk_optimizer
    assert (tiered.read_ahead > 0) == (reads > 0)


@given(tier_cases())
def test_fraction_zero_leaves_the_device_as_without_offload(case: dict[str, Any]) -> None:
    """offload_fraction 0: nothing in the optimizer's tier; the device holds what it holds
    without offload, plus the separate float32 master of float32 parameters."""
    case = {**case, "offload_fraction": 0.0, "offload_params": "none"}
    tiered = tiered_state_bytes(**case)
    plain = tiered_state_bytes(**{**case, "offload_optimizer": "none"})
    assert (tiered.host, tiered.disk, tiered.staging) == (0, 0, 0)
    separate = case["offload_optimizer"] != "none" and case["param_bytes"] == 4
    extra = 4 * case["params"] / case["world_size"] if separate else 0
    assert tiered.device == pytest.approx(plain.device + extra, rel=1e-12)


def test_stage3_disk_everything_leaves_nothing_on_the_device() -> None:
    """Stage 3, masters, states and parameter shards on disk: with the gradients kept
    there (``offload_gradients=False``) the device keeps the gradient shard 2 Ψ / N and
    the disk (2 + 12) Ψ / N; with them following the optimizer to disk (the default) the
    device keeps no model state and the disk (2 + 12 + 2) Ψ / N, each pipeline buffer
    holding a tile's gradient too. Host memory only staging buffers:
    the pipeline's, B x T x (4 + 8) with T = min(sub-group, bucket slice), and the
    parameters' reads (while forward and backward run), 2 bytes x 2 R / N for R =
    prefetch_numel (a slice at least)."""
    psi, n = 2**30, 8
    everything: dict[str, Any] = {
        "offload_optimizer": "disk", "offload_params": "disk", "sub_group_numel": 2**20,
        "buffer_count": 5, "bucket_numel": 2**22,
    }  # fmt: skip
    follow = tiered_state_bytes(psi, n, 3, offload_gradients=True, **everything)
    assert follow.device == follow.gradients == 2 * 2**19  # one landed bucket slice
    assert follow.disk == (2 + 12 + 2) * psi / n
    assert follow.staging == 5 * 2**19 * (12 + 2)
    tiered = tiered_state_bytes(psi, n, 3, offload_gradients=False, **everything)
    assert tiered.device == tiered.gradients == 2 * psi / n
    assert tiered.disk == (2 + 12) * psi / n
    assert tiered.host == 0
    reads = 2 * (2 * DEFAULT_PREFETCH_NUMEL / n)  # the default prefetch_numel
    assert tiered.staging == 5 * 2**19 * 12  # a bucket slice, 2**22 / 8, < 2**20
    assert tiered.read_ahead == reads  # only while forward and backward run
    no_prefetch = tiered_state_bytes(psi, n, 3, offload_params="disk", prefetch_numel=0)
    assert no_prefetch.read_ahead == 2 * 2**19  # one bucket slice's read buffer
    small = tiered_state_bytes(2**16, n, 3, offload_params="disk")
    assert small.read_ahead == small.disk == 2 * 2**16 / n  # read ahead whole
    bigger_tiles = tiered_state_bytes(psi, n, 3, offload_optimizer="disk", offload_gradients=False,
                                      sub_group_numel=2**20, largest_param_numel=2**26)  # fmt: skip
    assert bigger_tiles.staging == 4 * 2**20 * 12  # one parameter's slice, 2**23, is larger
    assert SLICE_ALIGNMENT == BLOCK  # what the engine pads bucket slices to
    few_tiles = tiered_state_bytes(4096, 2, 1, offload_optimizer="disk", sub_group_numel=1000)
    assert few_tiles.staging == 3 * 1000 * 12  # 2048 elements: 3 tiles, 3 buffers used


def test_float32_offload_keeps_the_parameter_and_moves_a_separate_master() -> None:
    """Float32 Adam at stage 2 is 4Ψ + (4 + 8)Ψ/N; with the optimizer on the host the
    device keeps 4Ψ + 4Ψ/N (parameters, gradient shard) and the host gets a float32 master
    and two moments, (4 + 8)Ψ/N: 4Ψ/N more than without offload."""
    psi, n = 1000, 4
    fp32: dict[str, Any] = {"optimizer_state_bytes": 8, "param_bytes": 4, "grad_bytes": 4}
    plain = tiered_state_bytes(psi, n, 2, **fp32)
    host = tiered_state_bytes(psi, n, 2, offload_optimizer="cpu", offload_gradients=False, **fp32)
    assert plain.device == 4 * psi + 4 * psi / n + 8 * psi / n and plain.master_weights == 0
    assert host.device == 4 * psi + 4 * psi / n
    follow = tiered_state_bytes(psi, n, 2, offload_optimizer="cpu", offload_gradients=True, **fp32)
    assert follow.host == (4 + 8 + 4) * psi / n
    # The gradient shard is one bucket slice here: it lands whole on the device first.
    assert follow.device == 4 * psi + 4 * psi / n
    big = tiered_state_bytes(2**30, n, 2, offload_optimizer="cpu", offload_gradients=True, **fp32)
    assert big.device == 4 * 2**30 + 4 * 2**20  # one landed slice: 2**22 / 4 elements
    assert host.host == (4 + 8) * psi / n
    assert host.model_states - plain.model_states == 4 * psi / n


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stage": 0, "offload_optimizer": "cpu"}, "needs stage 1, 2 or 3"),
    ({"stage": 2, "offload_params": "disk"}, "needs stage=3"),
    ({"offload_optimizer": "nvme"}, "offload_optimizer must be one of"),
    ({"offload_optimizer": "cpu", "offload_fraction": 1.5}, "offload_fraction"),
    ({"optimizer_state_bytes": 2, "offload_optimizer": "disk"}, "at least 4"),
    ({"buffer_count": 0}, "buffer_count"),
])  # fmt: skip
def test_bad_tier_input_is_named(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, Any] = {"params": 10, "world_size": 2, "stage": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        tiered_state_bytes(**args)


def test_cli_prints_each_tier_and_what_a_stage_cannot_offload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--offload-optimizer disk --offload-params cpu: stage 0 offloads nothing (n/a), stages
    1-2 the optimizer only, stage 3 both; the categories' total is device + host + disk
    less the staging buffers; --json says which tiers each stage applied."""
    argv = ["--params", "7.5e9", "--world-size", "64", "--offload-optimizer", "disk",
            "--offload-params", "cpu"]  # fmt: skip
    main([*argv, "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows["0"]["host"] is None and rows["0"]["disk"] is None
    assert rows["0"]["device"] == rows["0"]["total"] == 16 * 7.5e9
    assert [rows[s]["offload_params"] for s in "0123"] == ["none", "none", "none", "cpu"]
    assert [rows[s]["offload_optimizer"] for s in "0123"] == ["none", "disk", "disk", "disk"]
    for stage in "123":
        row = rows[stage]
        assert row["device"] + row["host"] - row["staging"] + row["disk"] == pytest.approx(
            row["total"]
        )
        gradients = 2 if stage in "23" else 0  # fp16, with the optimizer (stages 2-3)
        assert row["disk"] == pytest.approx((12 + gradients) * 7.5e9 / 64)
        assert row["tier_gradients"] == pytest.approx(gradients * 7.5e9 / 64)
        assert row["staging"] > 0
    assert rows["1"]["device"] == pytest.approx(4 * 7.5e9)  # parameters, full gradients
    landed = 2 * 2**22 / 64  # one bucket's reduced slice, waiting for its copy out
    assert rows["2"]["device"] == pytest.approx(2 * 7.5e9 + landed)  # + the parameters
    assert rows["3"]["device"] == landed
    assert rows["3"]["host"] == pytest.approx(2 * 7.5e9 / 64 + rows["3"]["staging"])
    main(argv)
    table = capsys.readouterr().out
    assert "device" in table and "host" in table and "disk" in table
    stage0 = next(line for line in table.splitlines() if "stage 0" in line)
    assert stage0.count("n/a") == 4  # host, disk, staging, read ahead
    main(["--params", "1e6", "--world-size", "2", "--offload-params", "disk", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [rows[s]["disk"] for s in "012"] == [None, None, None]  # nothing asked applies
    assert rows["3"]["disk"] == 2 * 1e6 / 2 and rows["3"]["parameters"] == 2 * 1e6 / 2
    with pytest.raises(SystemExit):
        main(["--params", "1e6", "--world-size", "2", "--offload-fraction", "2"])
    assert "--offload-fraction" in capsys.readouterr().err


def test_the_step_in_backward_holds_one_bucket_slice_of_gradients_at_stage_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fp32 Adam, 1e9 parameters on 4 ranks: stage 3's 16 bytes per parameter / N become
    12 plus one bucket slice; the other stages are as without the flag."""
    argv = ["--params", "1e9", "--world-size", "4", "--dtype", "fp32", "--json"]
    main(argv)
    plain = json.loads(capsys.readouterr().out)
    main([*argv, "--optimizer-in-backward"])
    fused = json.loads(capsys.readouterr().out)
    slice_bytes = 2**22 / 4 * 4
    assert fused["3"]["gradients"] == slice_bytes
    assert fused["3"]["total"] == pytest.approx(12 * 1e9 / 4 + slice_bytes)
    assert plain["3"]["total"] == pytest.approx(16 * 1e9 / 4)
    assert fused["3"]["device"] == plain["3"]["device"] - 4 * 1e9 / 4 + slice_bytes
    for stage in ("0", "1", "2"):
        assert fused[stage] == plain[stage]
    # The rule lives in tiered_state_bytes, which zero-train's out-of-memory line reads too.
    fp32 = {"param_bytes": 4, "grad_bytes": 4}
    assert tiered_state_bytes(1e9, 4, 3, optimizer_in_backward=True, **fp32).gradients == (
        slice_bytes
    )
    assert tiered_state_bytes(1e9, 4, 2, optimizer_in_backward=True, **fp32) == (
        tiered_state_bytes(1e9, 4, 2, **fp32)
    )


def test_float32_reduction_counts_4_byte_gradients_and_their_traffic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bf16 Adam with --reduce-dtype fp32 (ZeroConfig.reduce_dtype): each stage's gradient
    term is 4 bytes per element (4Ψ at stages 0-1, 4Ψ/N at 2-3) where bf16's is 2, and
    nothing else moves; the gradient collectives' bytes double (stage 0: all of them;
    stages 1-2: the reduce-scatter, half of 2Ψ; stage 3: a third of 3Ψ, less the head)."""
    argv = ["--params", "1e9", "--world-size", "4", "--dtype", "bf16", "--ranks-per-node", "4",
            "--no-backward-head", "--json"]  # fmt: skip
    main(argv)
    bf16 = json.loads(capsys.readouterr().out)
    main([*argv, "--reduce-dtype", "fp32"])
    fp32 = json.loads(capsys.readouterr().out)
    for stage, share in (("0", 1), ("1", 1), ("2", 1 / 4), ("3", 1 / 4)):
        assert bf16[stage]["gradients"] == pytest.approx(2e9 * share)
        assert fp32[stage]["gradients"] == pytest.approx(4e9 * share)
        assert fp32[stage]["total"] == pytest.approx(bf16[stage]["total"] + 2e9 * share)
        assert fp32[stage]["parameters"] == bf16[stage]["parameters"]
    ratio = {stage: fp32[stage]["intra_node_bytes"] / bf16[stage]["intra_node_bytes"]
             for stage in "0123"}  # fmt: skip
    assert ratio["0"] == pytest.approx(2.0)
    assert ratio["1"] == ratio["2"] == pytest.approx(1.5, rel=1e-6)  # + the int32 flag
    assert ratio["3"] == pytest.approx(4 / 3, rel=1e-6)
    plain = model_state_bytes(1e9, 4, 2, grad_bytes=4)
    assert plain.gradients == 4e9 / 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "fp32", "--reduce-dtype", "bf16"], "would round every torch.float32"),
        (["-K", "-100"], "-K -100.0 must be a number of bytes >= 0"),  # printed -96 GB
        (["-K", "nan"], "-K nan must be a number of bytes >= 0"),  # printed nan GB
        (["--params", "inf"], "--params must be a number >= 0"),
        (["--params", "nan"], "--params must be a number >= 0"),  # --json wrote NaN
        (["--accumulation", "0"], "--accumulation 0 must be at least 1"),
        (["--tp", "2"], "--tp and --checkpoint shape the activations"),  # ignored before
        (["--checkpoint", "full"], "--tp and --checkpoint shape the activations"),
        (["--optimizer-in-backward"], "cannot be combined with param_dtype=float16"),
        (["--optimizer-in-backward", "--dtype", "fp32", "--offload-params", "cpu"],
         "cannot be combined with offloaded model states"),
        (["--layers", "2", "--width", "32", "--heads", "3", "--vocab-size", "100",
          "--tokens", "64"], "width=32 does not divide into heads=3"),
        (["--layers", "2", "--width", "32", "--heads", "2", "--vocab-size", "100",
          "--tokens", "64", "--tp", "3"], "heads=2 does not divide over tensor-parallel degree 3"),
        (["--shard-group", "2", "--quantize-gradients", "int4"],
         "quantize_gradients with shard_group_size"),  # printed numbers the engine refuses
    ],
)  # fmt: skip
def test_what_the_engine_refuses_or_cannot_mean_is_refused_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probed: each of these printed a table (negative, nan or inf bytes, or options that
    were silently ignored, or a combination the engine refuses), with exit 0."""
    with pytest.raises(SystemExit) as stop:
        main(["--params", "1e6", "--world-size", "4", *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
