"""A rank killed for real (SIGKILL) inside its delayed parameter update, in the update's
background thread: the survivor's next collective names it, as without the delay (the
update itself runs no collective; zero_comm's failure reporting does the naming)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zero_comm.launch import free_port, rank_environment

HERE = Path(__file__).parent
TIMEOUT_S = 10.0


@pytest.mark.gloo
def test_a_rank_killed_in_its_delayed_update_is_named_by_the_survivor(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, str(HERE / "delayed_update_fault_rank.py"),
               "--folder", str(tmp_path), "--timeout", str(TIMEOUT_S)]  # fmt: skip
    processes = [
        subprocess.Popen(
            command,
            env=rank_environment(dict(os.environ), rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert processes[1].returncode == -signal.SIGKILL, outputs[1][1][-2000:]
    _, victim_pid, thread = (tmp_path / "killed_at").read_text().split()
    assert thread.startswith("zero-delayed-update-rank1"), thread  # died in the update
    assert processes[0].returncode == 3, outputs[0][1][-2000:]
    report = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert report["error"] in ("PeerFailureError", "CommTimeoutError"), report
    # "rank 1 (pid N)", or "rank 1 (host H, pid N)" where the peers know the host
    named = re.search(rf"rank 1 \((host \S+, )?pid {victim_pid}\) is dead", report["message"])
    assert named, report
    assert report["after_kill_s"] < TIMEOUT_S + 2, report
    assert "Traceback" not in outputs[0][1], outputs[0][1][-2000:]
