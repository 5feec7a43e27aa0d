"""zero_core.deepspeed on two real gloo ranks: init_distributed adopts the launcher's
world, the dataloader splits the data between the processes, a checkpoint round-trips."""

from __future__ import annotations

from pathlib import Path

import facade_bodies
import pytest

from zero_comm.testing import run_on_ranks


@pytest.mark.gloo
def test_a_deepspeed_script_runs_on_two_real_ranks(tmp_path: Path) -> None:
    reports = run_on_ranks(facade_bodies.deepspeed_script, 2, backend="gloo", launcher="spawn",
                           kwargs={"folder": str(tmp_path)}, timeout=120)  # fmt: skip
    first, second = (r["value"] for r in reports)
    assert first["world"] == 2
    assert len(first["seen"]) == len(second["seen"]) == 4
    assert not set(first["seen"]) & set(second["seen"])
    assert first["path"] == second["path"] == str(tmp_path / "global_step2")
    assert first["client_seen"] == second["client_seen"] == first["seen"]  # rank 0's
    assert len(first["losses"]) == 2
