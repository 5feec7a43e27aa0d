"""tools/gpu/check.py: fails loudly without a GPU, and its code runs (on CPU, for testing);
tools/gpu/mfu.py: the FLOPs formula, the batch plan against an H200's memory, the goal line;
packages/zero-core/tests/cuda_integrations_body.py (check.sh's framework part) on gloo."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tools.gpu import mfu
from zero_models.gpt import PRESETS

TOOL = ("-m", "tools.gpu.check")  # run as a module, with tool_env's PYTHONPATH
REPOSITORY = Path(__file__).resolve().parent.parent
INTEGRATIONS_BODY = REPOSITORY / "packages" / "zero-core" / "tests" / "cuda_integrations_body.py"


def _lightning_installed() -> bool:
    """Whether Lightning itself is importable (a folder named lightning on sys.path would
    be a namespace package of that name, with no origin)."""
    spec = importlib.util.find_spec("lightning")
    return spec is not None and spec.origin is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check itself runs")
def test_without_a_gpu_the_check_fails_and_says_why(tool_env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, *TOOL], capture_output=True, text=True,
                            timeout=120, env=tool_env)  # fmt: skip
    assert result.returncode == 1
    assert "FAILED: no CUDA device is visible to torch" in result.stderr


def test_the_check_runs_every_stage_on_cpu_when_allowed(
    tmp_path: Path, tool_env: dict[str, str]
) -> None:
    out = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, *TOOL, "--allow-cpu", "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=tool_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    # The MFU section: the goal run (ours, stage 3) first, FSDP2 beside it, the same batch.
    mfu = report["mfu"]
    assert [(r["peer"], r["stage"]) for r in mfu] == [
        ("ours", 3), ("fsdp2", 3), ("ours", 2), ("ours", 1), ("ours", 0)
    ]  # fmt: skip
    assert len({r["batch"] for r in mfu}) == 1
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in mfu)
    assert all(math.isfinite(r["last_loss"]) for r in mfu)
    # The goal line names the verdict; on a CPU it can only say "not met", and that it was
    # not measured on an H200.
    assert "not met" in report["mfu_goal"] and "not an H200" in report["mfu_goal"]
    assert "MFU: tokens/s x (6 Psi + 12 L C T) / 989 TFLOPS" in result.stdout
    rows = report["results"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["last_loss"] == r["last_loss"] for r in rows)
    assert all(r["step_estimate_gib"] > r["model_states_estimate_gib"] for r in rows)
    offload = report["offload"]
    assert [r.get("offload") for r in offload[:2]] == ["none", "cpu"]
    assert offload[1]["host_gib"] > 0 and offload[1]["tokens_per_s"] > 0
    fragmentation = report["fragmentation"]
    assert [r["contiguous"] for r in fragmentation] == [False, True]
    assert fragmentation[1]["arena_mib"] > 0 and fragmentation[1]["outside_arena"] == 0


@pytest.mark.gloo
def test_the_framework_body_passes_every_part_on_cpu_when_allowed() -> None:
    """check.sh's second part, on gloo and the CPU: the adopted group, zero_comm.init's
    own world, the backend-less group, and Lightning's stage 3 against stage 0 where
    Lightning is installed (the default test environment has no Lightning: the body says
    SKIP with the reason). About 10 s, 25 s with Lightning."""
    result = subprocess.run([sys.executable, str(INTEGRATIONS_BODY), "--allow-cpu"],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = result.stdout.splitlines()
    verdicts = [line for line in lines if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    expected = ["PASS adopt:", "PASS init:", "PASS auto:"]
    expected.append("PASS lightning:" if _lightning_installed() else "SKIP lightning:")
    assert [v.split(" ")[0] + " " + v.split(" ")[1] for v in verdicts] == expected, verdicts
    assert "drives gloo" in verdicts[2]
    if not _lightning_installed():
        assert "zero-core's extra [lightning]" in verdicts[3]


def test_a_spent_budget_lists_every_run_as_not_run(
    tmp_path: Path, tool_env: dict[str, str]
) -> None:
    out = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, *TOOL, "--allow-cpu", "--tiny", "--budget-s", "0",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=tool_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["not_run"] for r in report["mfu"]] == ["time budget"] * 5
    assert [r["not_run"] for r in report["results"]] == ["time budget"] * 4
    assert "not measured: time budget" in report["mfu_goal"]


# ---------------------------------------------------------------- mfu, pure parts
H200_BYTES = 139 * 2**30  # about what the lent H200 reports as its total memory


def test_flops_per_token_is_six_psi_plus_the_attention_term() -> None:
    config = PRESETS["gpt2"]
    psi = config.num_params
    assert mfu.flops_per_token(config, psi) == 6 * psi + 12 * 12 * 768 * 1024
    assert 124e6 < psi < 125e6  # GPT-2 small, the tied embedding counted once


def test_the_plan_fits_gpt2_xl_at_stage_0_on_an_h200_with_room_to_spare() -> None:
    config = PRESETS["gpt2-xl"]
    psi = config.num_params
    plan = mfu.mfu_plan(config, psi, H200_BYTES, fallback=4, max_batch=32)
    assert plan.skipped == {}
    peak = mfu.predicted_peak(config, psi, 0, plan.batch)
    assert peak <= mfu.FIT_FRACTION * H200_BYTES
    # the next candidate up would not fit: the plan takes the largest that does
    bigger = mfu.BATCH_CANDIDATES[mfu.BATCH_CANDIDATES.index(plan.batch) - 1]
    assert mfu.predicted_peak(config, psi, 0, bigger) > mfu.FIT_FRACTION * H200_BYTES


def test_the_plan_skips_what_does_not_fit_and_says_by_how_much() -> None:
    config = PRESETS["gpt2-xl"]
    psi = config.num_params
    # 16 bytes per parameter of model states alone: 23 GiB; no stage fits 20 GiB
    plan = mfu.mfu_plan(config, psi, 20 * 2**30, fallback=4, max_batch=32)
    assert sorted(plan.skipped) == [0, 1, 2, 3]
    assert all("GiB at batch 1 >" in why for why in plan.skipped.values())
    # on CPU: no capacity, the fallback batch, nothing skipped
    assert mfu.mfu_plan(config, psi, None, fallback=4, max_batch=32) == (4, {})


def test_the_goal_line_says_met_not_met_or_why_not_measured() -> None:
    row = {"preset": "gpt2-xl", "peer": "ours", "stage": 3, "mfu": 0.41}
    assert mfu.goal_line([row], "NVIDIA H200").endswith(": met: 41.0%")
    low = mfu.goal_line([{**row, "mfu": 0.39}], "NVIDIA H200")
    assert low.endswith(": not met: 39.0%")
    fsdp2_only = [{**row, "peer": "fsdp2", "mfu": 0.5}]
    assert "not measured: not in --mfu-presets" in mfu.goal_line(fsdp2_only, "NVIDIA H200")
    oom = [{"preset": "gpt2-xl", "peer": "ours", "stage": 3, "error": "OutOfMemoryError: x"}]
    assert "not measured: OutOfMemoryError" in mfu.goal_line(oom, "NVIDIA H200")


def test_the_goal_runs_first() -> None:
    order = mfu.mfu_order(["gpt2-xl", "gpt2"])
    assert order[:2] == [("gpt2-xl", "ours", 3), ("gpt2-xl", "fsdp2", 3)]
    assert sorted(order) == sorted(
        [(p, "ours", s) for p in ("gpt2-xl", "gpt2") for s in range(4)]
        + [(p, "fsdp2", 3) for p in ("gpt2-xl", "gpt2")]
    )


# ------------------------------------------------------- offload_check (ZeRO-Offload)
OFFLOAD_TOOL = ("-m", "tools.gpu.offload_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check itself runs")
def test_without_a_gpu_the_offload_check_fails_and_says_why(tool_env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, *OFFLOAD_TOOL], capture_output=True, text=True,
                            timeout=120, env=tool_env)  # fmt: skip
    assert result.returncode == 1
    assert "offload_check: FAILED: no CUDA device is visible" in result.stderr


def test_the_offload_check_runs_every_section_on_cpu_when_allowed(
    tmp_path: Path, tool_env: dict[str, str]
) -> None:
    """The tiny mode on gloo/CPU: every section, a few seconds."""
    out = tmp_path / "offload.json"
    result = subprocess.run(
        [sys.executable, *OFFLOAD_TOOL, "--allow-cpu", "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=tool_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    copies = [r for r in rows if r["section"] == "copies"]
    assert [r["pin"] for r in copies] == [True, False]
    assert all(r["values_equal"] and r["to_host_gb_s"] > 0 for r in copies)
    steps = [r for r in rows if r["section"] == "step"]
    keys = [(r["delayed_parameter_update"], r["offload_pin_memory"]) for r in steps]
    assert keys == [(False, True), (True, True), (False, False)]
    assert steps[0]["step_s"] > 0 and steps[2]["step_s"] > 0
    if report["dpu_available"]:
        assert steps[1]["step_s"] > 0
    else:
        assert steps[1]["not_run"] == "DPU not available"
        assert "DPU not available" in result.stdout
    summaries = [r for r in rows if r["section"] == "largest-summary"]
    assert [r["offload"] for r in summaries] == ["cpu", "none"]
    assert all(r["largest_parameters"] > 0 for r in summaries)
    assert "| largest | offload=cpu |" in result.stdout


def test_the_offload_search_climbs_steps_down_and_respects_its_caps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search over the ladder, with training replaced: rungs past 32 layers run out
    of memory, and --max-params refuses the rungs past it without trying them."""
    from tools.gpu import offload_check

    tried: list[int] = []

    def fake_train(config: object, *_: object, **__: object) -> dict[str, float]:
        layers = config.layers  # type: ignore[attr-defined]
        tried.append(layers)
        if layers > 32:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return {"step_s": 1.0}

    monkeypatch.setattr(offload_check, "train", fake_train)

    class Comm:
        device = torch.device("cpu")  # no capacity: the search starts at the top rung

    args = offload_check.argparse.Namespace(
        tiny=False, max_params=3e9, host_fraction=1e9, search_batch=1
    )
    rows: list[dict[str, object]] = []
    summary = offload_check.search(Comm(), args, "cpu", float("inf"), rows.append)  # type: ignore[arg-type]
    # 128..64 layers are past 3e9 parameters (not tried), 48 runs out of memory, 32 trains
    assert tried == [48, 32]
    assert summary["largest_layers"] == 32 and summary["next"] == "out of memory"
    refused = [r["layers"] for r in rows if str(r["outcome"]).startswith("not tried: past")]
    assert refused == [128, 96, 80, 64]
    # Climbing from rung 2 at 4 s per 1e9 parameters with 8.5 s left: 32 layers (1.74e9,
    # ~7 s) is tried, 48 layers (2.55e9, ~10 s) is not, for time.
    tried.clear()
    climbed = offload_check.search(
        Comm(), args, "cpu", time.perf_counter() + 8.5, rows.append, start=2,  # type: ignore[arg-type]
        pace=[4e-9],
    )  # fmt: skip
    assert tried == [16, 24, 32]
    assert climbed["largest_layers"] == 32
    assert str(climbed["next"]).startswith("not tried: time budget")
    tried.clear()
    rows.clear()
    spent = offload_check.search(Comm(), args, "cpu", 0.0, rows.append)  # type: ignore[arg-type]
    assert tried == [] and spent["largest_parameters"] is None
