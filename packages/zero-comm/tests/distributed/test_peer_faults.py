"""A peer that stops, lags, leaves or dies while another rank waits in a collective, on
real gloo ranks (peer_fault_rank.py): a stopped peer is named within the heartbeat timeout,
not the collective timeout (316 s before: zero_comm.heartbeat); a slow peer that beats is
waited for; one that exited cleanly is named as soon as its check-out is seen (303 s
before); and rank 0's death, which takes the rendezvous store with it, is one line on
the survivor, naming rank 0 and its store, without c10d's C++ stacks (zero_comm.c10d_log)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_comm.launch import free_port, rank_environment
from zero_comm.testing import find_mpiexec, is_open_mpi

HERE = Path(__file__).parent
HEARTBEAT_S = 3.0
# What a survivor may take beyond the heartbeat timeout to name a stopped peer: up to two
# beats (0.3 s each) to read it, the last chance given to the collective (1 s), and the
# scheduling of 2 ranks on 2 loaded cores.
NAMING_SLACK_S = 5.0


def run_pair(case: str, folder: Path, heartbeat: float = HEARTBEAT_S) -> list[tuple[int, str, str]]:
    """peer_fault_rank.py's two ranks, started by hand: (exit code, stdout, stderr) of
    each. A rank still running 20 s after the other ended (the stopped one) is killed."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "peer_fault_rank.py"), case, str(folder), str(heartbeat)],
            env=rank_environment(dict(os.environ), rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + 90
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, min(20.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    return results


def report(result: tuple[int, str, str]) -> dict[str, object]:
    code, out, err = result
    assert out.strip(), f"exit {code}, nothing on stdout:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def one_line(err: str) -> str:
    """The survivor's stderr, checked to be its one line about the failure."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err[-3000:]}"
    for noise in ("c10d", "recvValue", "frame #", "Traceback"):
        assert noise not in err, err[-3000:]
    return lines[0]


def victim_pid(folder: Path) -> int:
    return int((folder / "event").read_text().split()[2])


# The default run keeps the two quick cases (a peer that left, rank 0 killed: ~15 s);
# zero-models' test_run_control stops a rank of zero-train under --heartbeat-timeout.
# `nox -s faults` runs these two as well (each waits out heartbeat timeouts).
SLOW = pytest.mark.faults


@pytest.mark.gloo
@SLOW
def test_a_peer_stopped_inside_a_collective_is_named_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 SIGSTOPs itself while rank 0 waits for it in an all-reduce. Rank 0 names it
    as stopped, with its host and pid, within HEARTBEAT_S + NAMING_SLACK_S (the collective
    timeout is 120 s), and exits with its own code at once: the gloo collective left in
    flight on the stopped peer does not hold its exit (nor abort it) until that timeout
    (run_pair gives it 90 s)."""
    results = run_pair("stop", tmp_path)
    code, _, err = results[0]
    assert code == 3, err[-3000:]
    said = report(results[0])
    assert said["error"] == "PeerFailureError", said
    assert HEARTBEAT_S < float(said["after_s"]) < HEARTBEAT_S + NAMING_SLACK_S, said  # type: ignore[arg-type]
    line = one_line(err)
    pid = victim_pid(tmp_path)
    assert f"rank 1 (host {socket.gethostname()}, pid {pid}) has sent no heartbeat" in line, line
    assert f"it is stopped (SIGSTOP or Ctrl-Z: kill -CONT {pid} to go on)" in line, line
    assert line.startswith("zero-comm: [rank 0] all_reduce"), line
    assert results[1][0] == -signal.SIGKILL  # still stopped when rank 0 had ended


@pytest.mark.gloo
@SLOW
def test_a_slow_peer_that_beats_is_waited_for(tmp_path: Path) -> None:
    """Rank 1 sleeps three heartbeat timeouts before it joins the all-reduce; its
    heartbeat beats meanwhile, so rank 0 waits (the collective timeout is 120 s) and both
    complete it."""
    results = run_pair("slow", tmp_path)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank}: exit {code}\n{err[-3000:]}"
        assert report(results[rank]) == {"rank": rank, "error": None}


@pytest.mark.gloo
def test_a_peer_that_exited_cleanly_is_named_at_its_check_out(tmp_path: Path) -> None:
    """Rank 1's script ends (exit 0) while rank 0 waits for it in an all-reduce: rank 0
    names it, as having left, within 2 s (no heartbeat timeout to wait out: its check-out
    is read on the next beat)."""
    results = run_pair("leave", tmp_path, heartbeat=30.0)
    assert results[1][0] == 0, results[1][2][-3000:]
    code, _, err = results[0]
    assert code == 3, err[-3000:]
    said = report(results[0])
    assert said["error"] == "PeerFailureError", said
    assert float(said["after_s"]) < 2.5, said  # type: ignore[arg-type]
    line = one_line(err)
    pid = victim_pid(tmp_path)
    named = f"rank 1 (host {socket.gethostname()}, pid {pid}) left the job (its script ended)"
    assert named in line, line


@pytest.mark.gloo
def test_a_peer_that_leaves_on_a_fatal_error_is_named_with_why(tmp_path: Path) -> None:
    """Rank 1 ends as zero-train's rank that ran out of memory does: comm.leave(why),
    then os._exit (no interpreter exit, so no check-out of its own). Rank 0, waiting in
    the digest check's store wait, names it and why in one line within 2.5 s, not after
    the heartbeat timeout (30 s)."""
    results = run_pair("leave1", tmp_path, heartbeat=30.0)
    assert results[1][0] == 71, results[1][2][-3000:]
    code, _, err = results[0]
    assert code == 3, err[-3000:]
    said = report(results[0])
    assert said["error"] == "PeerFailureError", said
    assert float(said["after_s"]) < 2.5, said  # type: ignore[arg-type]
    line = one_line(err)
    pid = victim_pid(tmp_path)
    named = f"rank 1 (host {socket.gethostname()}, pid {pid}) left the job (it ran out of memory"
    assert named in line, line


@pytest.mark.gloo
def test_a_peer_killed_while_the_store_lives_on_is_named_dead_at_once(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed (the kernel's OOM killer) while rank 0 waits in the digest
    check's store wait: no connection of rank 0's fails (the store is its own), and rank 1
    never checks out. Rank 0 names it as dead (/proc) within 2.5 s; before, as not beating,
    after the heartbeat timeout (30 s here, 60 s by default)."""
    results = run_pair("kill1", tmp_path, heartbeat=30.0)
    assert results[1][0] == -signal.SIGKILL, results[1][2][-3000:]
    code, _, err = results[0]
    assert code == 3, err[-3000:]
    said = report(results[0])
    assert said["error"] == "PeerFailureError", said
    assert float(said["after_s"]) < 2.5, said  # type: ignore[arg-type]
    line = one_line(err)
    pid = victim_pid(tmp_path)
    assert f"rank 1 (host {socket.gethostname()}, pid {pid}) is dead" in line, line


@pytest.mark.gloo
def test_rank_0_killed_is_one_line_naming_it_and_its_store(tmp_path: Path) -> None:
    """Rank 0 hosts the rendezvous store; SIGKILLed while rank 1 waits, it takes the store
    with it. Rank 1's stderr is one line naming rank 0 and the store, with none of the
    c10d C++ warnings and stacks ("recvValue failed", "frame #") it printed before."""
    results = run_pair("kill0", tmp_path)
    assert results[0][0] == -signal.SIGKILL
    code, _, err = results[1]
    assert code == 3, err[-3000:]
    said = report(results[1])
    assert said["error"] == "PeerFailureError", said
    assert float(said["after_s"]) < 5, said  # type: ignore[arg-type]
    line = one_line(err)
    assert "rank 0" in line and "rendezvous store" in line, line
    rank_0 = f"rank 0 (host {socket.gethostname()}, pid {victim_pid(tmp_path)}) is dead"
    assert rank_0 in line, line


@pytest.mark.mpi
@SLOW
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")
def test_under_mpiexec_a_stopped_peer_is_named_within_the_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    """The same stop on the mpi backend: the heartbeat lives in a store that rank 0 opens
    and announces over MPI (rendezvous.heartbeat_over_mpi), and the MPI wait's polling
    asks it; mpiexec then ends the stopped rank."""
    mpiexec = str(find_mpiexec())
    flags = ["--oversubscribe"] if is_open_mpi(mpiexec) else []
    command = [mpiexec, *flags, "-n", "2", sys.executable, "-m", "mpi4py",
               str(HERE / "peer_fault_rank.py"), "stop", str(tmp_path), str(HEARTBEAT_S),
               "mpi"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    said = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert said["error"] == "PeerFailureError", said
    assert HEARTBEAT_S < float(said["after_s"]) < HEARTBEAT_S + NAMING_SLACK_S, said
    pid = victim_pid(tmp_path)
    assert f"rank 1 (host {socket.gethostname()}, pid {pid}) has sent no heartbeat" in (
        result.stderr
    ), result.stderr[-3000:]
    for noise in ("c10d", "recvValue", "frame #"):
        assert noise not in result.stderr, result.stderr[-3000:]
