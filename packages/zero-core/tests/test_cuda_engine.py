"""The engine on a CUDA GPU (cuda_engine_body.py, in its own process); skipped without one.

CI has no GPU: this runs where one is lent (tools/gpu/check.sh runs it first). The CPU
suite's guard against CPU-only bugs of this kind is test_explicit_devices.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
def test_engine_on_one_gpu_equals_stage_0_and_resumes_bit_for_bit() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one process of its own: world size 1
    done = subprocess.run(
        [sys.executable, str(HERE / "cuda_engine_body.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
