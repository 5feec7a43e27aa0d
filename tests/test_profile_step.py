"""tools/diagnose/profile_step.py: the phases of one step add up, waits (the engine's zero::
ranges) land in the phase that was open, and every variant it times trains the same model (so
the profile is of a real step).

Losses agree to 1e-4 relative, not bit for bit: DDP divides each gradient by N before its
all-reduce and our engine after, and the collectives may sum in different orders (the same
tolerance and reason as tests/test_bench_peers.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.diagnose import profile_step


def test_waits_count_in_the_phase_around_them_once_and_on_the_main_thread_only() -> None:
    """The columns from one step's ranges (microseconds): a wait nested in another
    counts once, a wait across two phases is split between them, gather-unit and swap
    waits are not collective waits, and another thread's ranges do not count."""
    span = profile_step.Span
    spans = [
        span("phase: forward", 1, 0, 100), span("phase: backward", 1, 100, 300),
        span("phase: step", 1, 300, 500),
        span("zero::gather_unit.wait", 1, 10, 40),  # not a collective's wait
        span("zero::all_gather.wait", 1, 20, 30),
        span("zero::reduce_scatter.wait", 1, 150, 200),
        span("zero::all_reduce.wait", 1, 160, 220),  # overlaps the one above: 150-220
        span("zero::all_reduce.wait", 1, 290, 310),  # 10 in backward, 10 in step
        span("zero::optimizer_step", 1, 320, 360), span("zero::optimizer_step", 1, 380, 420),
        span("zero::all_gather.wait", 1, 440, 470),
        span("zero::swap.read.wait", 1, 430, 435),
        span("zero::all_gather.wait", 2, 0, 500),  # another thread: ignored
        span("zero::optimizer_step", 2, 0, 500),
    ]  # fmt: skip
    columns = profile_step.ranged_columns(spans)
    assert columns is not None
    assert columns["forward_wait"] == pytest.approx(10e-6)
    assert columns["backward_wait"] == pytest.approx(80e-6)
    assert columns["step_wait"] == pytest.approx(40e-6)
    assert columns["optimizer"] == pytest.approx(80e-6)
    assert columns["publish"] == pytest.approx(80e-6)  # the last optimizer step's end to 500
    assert profile_step.ranged_columns(spans[:3]) is None, "code without ranges: no column"


def test_config_overrides_parse_numbers_and_refuse_a_missing_value() -> None:
    parsed = profile_step.parse_options(["bucket_numel=1024", "prefetch_numel=2e6", "x=abc"])
    assert parsed == {"bucket_numel": 1024, "prefetch_numel": 2e6, "x": "abc"}
    with pytest.raises(ValueError, match="write key=value"):
        profile_step.parse_options(["bucket_numel"])


@pytest.mark.gloo
@pytest.mark.timeout(300)
def test_two_ranks_profile_every_stage_and_ddp(tmp_path: Path, tool_env: dict[str, str]) -> None:
    out, md = tmp_path / "profile.json", tmp_path / "profile.md"
    result = subprocess.run(
        [sys.executable, "-m", "zero_comm.launch", "-n", "2", sys.executable, "-m",
         "tools.diagnose.profile_step", "--size", "smoke", "--warmup", "1", "--steps", "2",
         "--ddp", "--json", str(out), "--markdown", str(md), "--trace", str(tmp_path / "trace"),
         "--top", "5"],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**tool_env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = json.loads(out.read_text())["summaries"]
    assert list(summaries) == ["ours-0", "ours-1", "ours-2", "ours-3", "ddp"]
    for name, s in summaries.items():
        assert s["steps"] == 2, name
        assert s["total_min"] <= s["total"] <= s["total_max"], name
        assert s["vs"] == "ddp" and s["ratio_min"] <= s["ratio"] <= s["ratio_max"], name
        assert len(s["totals_ms"]) == 2, name
        assert s["last_loss"] == pytest.approx(summaries["ddp"]["last_loss"], rel=1e-4), name
        if name == "ddp":  # its waits happen inside autograd, where no zero:: range is
            assert s["backward_wait"] is None and s["optimizer"] is None
            continue
        for phase in ("forward", "backward", "step"):
            assert 0 <= s[f"{phase}_wait"] <= s[phase], (name, phase)
        assert s["optimizer"] > 0 and s["optimizer"] + s["publish"] <= s["step"], name
    # stages 1-2 all-gather the new parameters in publish: the ranges must have shown it
    assert summaries["ours-1"]["publish"] > 0 and summaries["ours-2"]["publish"] > 0
    assert summaries["ddp"]["ratio"] == 1.0
    text = md.read_text()
    for name in summaries:
        assert f"| {name} |" in text
        assert (tmp_path / "trace" / f"{name}.json").stat().st_size > 0
        assert (tmp_path / "trace" / f"{name}.rank1.json").stat().st_size > 0
    assert "top 5 operators by self CPU time" in text
