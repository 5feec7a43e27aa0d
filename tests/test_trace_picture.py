"""tools/diagnose/trace_picture.py: ranges nest by time on each thread (a child one row below its
parent, a sibling on the parent's row), ``--within`` keeps the ranges of one window, and a
picture is written from a real profiler trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tools.diagnose import trace_picture


def test_nested_ranges_stack_and_siblings_share_a_row() -> None:
    ranges = [("phase: forward", 0.0, 100.0), ("zero::gather_unit", 10.0, 20.0),
              ("zero::all_gather", 12.0, 18.0), ("zero::gather_unit.wait", 20.0, 60.0),
              ("zero::all_gather.wait", 30.0, 60.0), ("phase: backward", 100.0, 150.0)]  # fmt: skip
    bars = {b.name: b for b in trace_picture.stacked(ranges, origin=0.0)}
    depths = {name: bar.depth for name, bar in bars.items()}
    assert depths == {"phase: forward": 0, "zero::gather_unit": 1, "zero::all_gather": 2,
                      "zero::gather_unit.wait": 1, "zero::all_gather.wait": 2,
                      "phase: backward": 0}  # fmt: skip
    assert bars["zero::all_gather.wait"].start == pytest.approx(0.030)  # milliseconds


def test_within_keeps_one_window_and_a_picture_is_drawn(
    tmp_path: Path, tool_env: dict[str, str]
) -> None:
    pytest.importorskip("matplotlib")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("zero::before"):
            torch.ones(8).add_(1)
        with record_function("step"), record_function("zero::inside"):
            torch.ones(8).add_(1)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    lanes = trace_picture.read_ranges(trace, ("zero::",), within="step")
    assert [name for ranges in lanes.values() for name, _, _ in ranges] == ["zero::inside"]
    assert json.loads(trace.read_text())["traceEvents"]
    png = tmp_path / "step.png"
    done = subprocess.run(
        [sys.executable, "-m", "tools.diagnose.trace_picture", str(trace), "--within", "step",
         "--output", str(png)],
        capture_output=True, text=True, timeout=120, env=tool_env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
