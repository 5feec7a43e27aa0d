"""A rank that exits after a peer died, with collectives it issued still in flight, ends
with its own exit code: not SIGABRT from a gloo worker thread ("terminate called without
an active exception") as the interpreter finalizes. See
zero_comm.world_session.InFlightCollectives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_comm.launch import free_port, rank_environment

HERE = Path(__file__).parent


def run_three_ranks(folder: Path) -> list[tuple[int, str, str]]:
    """exit_in_flight_rank.py on ranks 0..2 started by hand: (exit code, stdout, stderr)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "exit_in_flight_rank.py"), str(folder)],
            env=rank_environment(dict(os.environ), rank, 3, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    results = []
    deadline = time.monotonic() + 90
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return results


def check_survivors(results: list[tuple[int, str, str]]) -> None:
    assert results[1][0] == -signal.SIGKILL, results[1]
    reports = {}
    for rank in (2, 0):  # rank 2's exit first: the one with a collective in flight
        code, out, err = results[rank]
        assert "terminate called" not in err, f"rank {rank} aborted at exit:\n{err[-3000:]}"
        assert code == 3, f"rank {rank} exited with {code}:\n{err[-3000:]}"
        reports[rank] = json.loads(out.strip().splitlines()[-1])
        assert reports[rank]["error"] in ("PeerFailureError", "CommTimeoutError"), reports[rank]
        assert "rank 1 (pid" in reports[rank]["message"], reports[rank]
    # The failed world communicator refuses the next collective, naming where it failed,
    # and closes without a barrier that no dead rank can join.
    assert "failed at all_reduce #" in reports[0]["then"], reports[0]
    assert reports[0]["close_s"] < 2, reports[0]
    # Rank 2's reduce-scatter, left in flight, ended with rank 0's part as rank 2 exited.
    assert reports[0]["reduced"] == [3.0], reports[0]


@pytest.mark.gloo
def test_a_survivor_exits_with_its_code_while_its_collectives_end(tmp_path: Path) -> None:
    started = time.monotonic()
    check_survivors(run_three_ranks(tmp_path))
    # Rank 0 hosts the store; it does not wait at exit for the dead rank to check out.
    assert time.monotonic() - started < 60


@pytest.mark.gloo
@pytest.mark.slow
def test_survivors_exit_with_their_code_every_time(tmp_path: Path) -> None:
    """The same, five times over: the abort it guards against was a race."""
    for attempt in range(5):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        check_survivors(run_three_ranks(folder))
