"""tools/gpu_check.py: fails loudly without a GPU, and its code runs (on CPU, for testing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check itself runs")
def test_without_a_gpu_the_check_fails_and_says_why() -> None:
    result = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert "FAILED: no CUDA device is visible to torch" in result.stderr


def test_the_check_runs_every_stage_on_cpu_when_allowed(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, str(TOOL), "--allow-cpu", "--presets", "test", "--steps", "1",
         "--warmup", "1", "--fragmentation-preset", "test", "--fragmentation-steps", "2",
         "--offload-preset", "test",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["last_loss"] == r["last_loss"] for r in rows)
    assert all(r["step_estimate_gib"] > r["model_states_estimate_gib"] for r in rows)
    offload = json.loads(out.read_text())["offload"]
    assert [r.get("offload") for r in offload[:2]] == ["none", "cpu"]
    assert offload[1]["host_gib"] > 0 and offload[1]["tokens_per_s"] > 0
    fragmentation = json.loads(out.read_text())["fragmentation"]
    assert [r["contiguous"] for r in fragmentation] == [False, True]
    assert fragmentation[1]["arena_mib"] > 0 and fragmentation[1]["outside_arena"] == 0
