"""zero_comm.init: backend choice, and the errors for backends that cannot run here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zero_comm.launcher_env import detect_launch_env
from zero_comm.world import resolve_backend


def test_auto_picks_gloo_without_cuda_or_mpi_launcher() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: auto picks nccl")
    assert resolve_backend("auto", detect_launch_env({})) == "gloo"


def test_auto_picks_mpi_under_an_mpi_launcher_when_mpi4py_imports() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: auto picks nccl")
    env = detect_launch_env({"PMI_RANK": "0", "PMI_SIZE": "2"})
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        assert resolve_backend("auto", env) == "gloo"
    else:
        assert resolve_backend("auto", env) == "mpi"


def test_explicit_backends_are_kept_and_unknown_ones_named() -> None:
    env = detect_launch_env({})
    assert [resolve_backend(b, env) for b in ("gloo", "nccl", "mpi")] == ["gloo", "nccl", "mpi"]
    with pytest.raises(ValueError, match="backend='ucc' is not one of"):
        resolve_backend("ucc", env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: nccl can run here")
def test_nccl_without_a_gpu_says_what_to_use_instead() -> None:
    code = "import zero_comm; zero_comm.init('nccl')"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "BackendUnavailableError: [rank 0] backend 'nccl' needs CUDA" in result.stderr
    assert "use backend='gloo'" in result.stderr


def test_single_process_world_needs_no_launcher() -> None:
    code = (
        "import torch, zero_comm\n"
        "comm = zero_comm.init('gloo')\n"
        "x = torch.ones(3); comm.all_reduce(x); comm.barrier()\n"
        "assert (comm.rank, comm.world_size, x.tolist()) == (0, 1, [1.0] * 3)\n"
        "comm.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_nonpositive_timeout_is_refused() -> None:
    import zero_comm

    with pytest.raises(ValueError, match="timeout must be a positive"):
        zero_comm.init("gloo", timeout=0)
