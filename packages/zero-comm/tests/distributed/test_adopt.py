"""zero_comm over a world someone else made (zero_comm.adopt), on 2 real gloo ranks that
call torch.distributed.init_process_group themselves (adopt_rank.py, torchrun-style
variables, started by hand), and under mpiexec on a Split of MPI.COMM_WORLD.

Before: ``zero_comm.from_process_group`` did not exist; ``zero_comm.init()`` after the
script's own ``init_process_group`` reused the group with no peers and no heartbeat, so a
SIGKILLed peer was not named. After: the adopted default group, ``init()``'s adoption of
it and an adopted subgroup give the same bits as a world ``zero_comm.init`` made, with
peers, heartbeat, topology and the digest check; the survivor names the killed rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from zero_comm.launch import free_port, rank_environment
from zero_comm.testing import find_mpiexec, is_open_mpi

HERE = Path(__file__).parent
RANK_SCRIPT = str(HERE / "adopt_rank.py")
RUN_LIMIT_S = 90.0


def run_ranks(case: str, folder: Path) -> list[tuple[int, str, str]]:
    """adopt_rank.py's two ranks: (exit code, stdout, stderr) of each; killed past the limit."""
    port = free_port()
    threads = str(torch.get_num_threads())
    procs = [
        subprocess.Popen(
            [sys.executable, RANK_SCRIPT, case, str(folder)],
            env=rank_environment(dict(os.environ, OMP_NUM_THREADS=threads), rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    return [_finish(proc, time.monotonic() + RUN_LIMIT_S) for proc in procs]


def _finish(proc: subprocess.Popen[str], deadline: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def reports(results: list[tuple[int, str, str]], codes: tuple[int, ...] = (0, 0)) -> list[Any]:
    for rank, (code, out, err) in enumerate(results):
        assert code == codes[rank], f"rank {rank} exit {code}:\n{out[-2000:]}\n{err[-3000:]}"
    return [
        json.loads(out.strip().splitlines()[-1]) if out.strip() else None for _, out, _ in results
    ]


def assert_same_bits(folder: Path, name: str, reference: str = "fresh") -> None:
    for rank in range(2):
        got = torch.load(folder / f"{name}-{rank}.pt")
        want = torch.load(folder / f"{reference}-{rank}.pt")
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name} rank {rank}: {key} differs"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same collectives on a world zero_comm.init made."""
    folder = tmp_path_factory.mktemp("adopt")
    reports(run_ranks("fresh", folder))
    return folder


@pytest.mark.gloo
@pytest.mark.timeout(120)
def test_adopted_groups_equal_a_fresh_world_bit_for_bit(fresh: Path) -> None:
    results = run_ranks("adopted", fresh)
    done = reports(results)
    for rank, report in enumerate(done):
        swapped = report["swapped"]
        assert swapped["rank"] == 1 - rank and swapped["topology_source"] == "hostname", swapped
        assert not swapped["heartbeat"], swapped  # world rank 0 hosts the store: said below
        if rank == 0:
            assert "not a member" in report["not_a_member"] and "[1]" in report["not_a_member"]
        else:
            assert report["alone"]["world_size"] == 1, report
        for name, timeout in (("world", 45.0), ("init", 50.0), ("sub", 300.0)):
            facts = report[name]
            assert (facts["rank"], facts["world_size"], facts["backend"]) == (rank, 2, "gloo")
            assert facts["deterministic"] and facts["timeout"] == timeout, facts  # options apply
            assert len(facts["peers"]) == 2 and facts["heartbeat"], facts
            assert facts["topology"] == [0, 0], facts
        assert "ranks disagree" in report["mismatch"] and "numel=5" in report["mismatch"]
        assert report["still_initialised"], "closing an adopted communicator destroyed the group"
    for name in ("world", "init", "sub", "swapped"):
        assert_same_bits(fresh, name)
    logs = [err for _, _, err in results]
    for err in logs:
        assert err.count("adopting its default group instead of creating a world") == 1, err
    said = "no heartbeat on the adopted group (the store's host, world rank 0, is not"
    assert sum(err.count(said) for err in logs) == 1, logs  # once, not per rank


@pytest.mark.gloo
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "exit_code", "said"), [("kill", -9, "is dead"), ("leave", 0, "left the job")]
)
def test_a_killed_or_departed_rank_is_named_on_an_adopted_world(
    tmp_path: Path, case: str, exit_code: int, said: str
) -> None:
    (_, out, _), (code, _, err) = run_ranks(case, tmp_path)
    assert code == exit_code, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["error"] == "PeerFailureError", report
    assert "rank 1" in report["message"] and said in report["message"], report
    assert report["after_s"] < 10.0, report  # not the 45 s collective timeout


needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None, reason="no mpiexec: pip install mpich mpi4py (nox -s tests_mpi does)"
)


@pytest.mark.mpi
@needs_mpi
@pytest.mark.timeout(120)
def test_an_adopted_mpi_split_equals_a_fresh_world_bit_for_bit(fresh: Path) -> None:
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    extra = ["--oversubscribe"] if is_open_mpi(mpiexec) else []
    threads = str(torch.get_num_threads())
    proc = subprocess.run(
        [
            mpiexec,
            *extra,
            "-n",
            "2",
            sys.executable,
            "-m",
            "mpi4py",
            RANK_SCRIPT,
            "mpi",
            str(fresh),
        ],
        env=dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads),
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads((fresh / f"mpi-report-{rank}.json").read_text()) for rank in range(2)]
    assert sorted(r["mpi"]["rank"] for r in lines) == [0, 1]
    for report in lines:
        assert report["mpi"]["backend"] == "mpi" and report["mpi"]["heartbeat"], report
        assert "ranks disagree" in report["mismatch"], report
        assert report["still_usable"], report
    assert_same_bits(fresh, "mpi")
