"""The bit-for-bit stage suite over real processes: gloo under zero-launch, MPI under mpiexec."""

from __future__ import annotations

import pytest
import stage_bodies

from zero_comm.testing import find_mpiexec, run_on_ranks


@pytest.mark.parametrize(
    ("backend", "launcher"),
    [
        pytest.param("gloo", "spawn", marks=pytest.mark.gloo, id="gloo"),
        pytest.param(
            "mpi", "mpiexec", id="mpi",
            marks=[pytest.mark.mpi,
                   pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")],
        ),
    ],
)  # fmt: skip
def test_stages_equal_stage_0_on_three_real_ranks(backend: str, launcher: str) -> None:
    reports = run_on_ranks(stage_bodies.parity_suite, 3, backend=backend, launcher=launcher,
                           kwargs={"examples": 15}, timeout=300)  # fmt: skip
    assert [r["value"] for r in reports] == [15, 15, 15]
