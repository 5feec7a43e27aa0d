"""Real processes: the collective properties and the failure modes on gloo, MPI and NCCL.

Each test starts its ranks with zero_comm.testing.run_on_ranks, under zero-launch
("spawn"), torchrun or mpiexec. Markers select the backend (nox -s tests_gloo / tests_mpi /
tests_nccl).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from fractions import Fraction

import fails_to_import_on_rank_one
import pytest
import rank_bodies
import torch

from zero_comm.testing import RanksFailed, find_mpiexec, run_on_ranks

needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None, reason="no mpiexec: pip install mpich mpi4py (nox -s tests_mpi does)"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the nccl backend needs a GPU"
)

GLOO = pytest.mark.gloo
MPI = [pytest.mark.mpi, needs_mpi]
# Four ranks on this project's 2-core CI machines cost twice three; the default run proves
# the same properties at 3 (a sum of three terms already has more than one order).
SLOW = pytest.mark.slow
NCCL = [pytest.mark.nccl, needs_cuda]

WORLDS = [
    pytest.param("gloo", "spawn", 3, marks=GLOO, id="gloo-spawn-3"),
    pytest.param("gloo", "spawn", 4, marks=[GLOO, SLOW], id="gloo-spawn-4"),
    pytest.param("gloo", "torchrun", 2, marks=GLOO, id="gloo-torchrun-2"),
    pytest.param("mpi", "mpiexec", 3, marks=MPI, id="mpi-mpiexec-3"),
    pytest.param("mpi", "mpiexec", 4, marks=[*MPI, SLOW], id="mpi-mpiexec-4"),
    pytest.param("gloo", "mpiexec", 3, marks=MPI, id="gloo-under-mpiexec-3"),
    pytest.param("nccl", "spawn", 1, marks=NCCL, id="nccl-spawn-1"),
]
FAILURE_WORLDS = [
    pytest.param("gloo", "spawn", marks=GLOO, id="gloo-spawn"),
    pytest.param("mpi", "mpiexec", marks=MPI, id="mpi-mpiexec"),
]


@pytest.mark.parametrize(("backend", "launcher", "world_size"), WORLDS)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "native"])
def test_collective_properties_on_real_ranks(
    backend: str, launcher: str, world_size: int, deterministic: bool
) -> None:
    reports = run_on_ranks(
        rank_bodies.collective_properties, world_size, backend=backend, launcher=launcher,
        deterministic=deterministic, kwargs={"examples": 40},
    )  # fmt: skip
    assert [r["value"] for r in reports] == [40] * world_size


@pytest.mark.parametrize(
    ("backend", "launcher"),
    [pytest.param("gloo", "spawn", marks=GLOO), pytest.param("mpi", "mpiexec", marks=MPI)],
)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "native"])
def test_row_collectives_on_real_ranks(backend: str, launcher: str, deterministic: bool) -> None:
    """Virtual ranks (2, 1, 3) on three processes: the rows' fold, as one process does it."""
    reports = run_on_ranks(
        rank_bodies.row_collectives_equal_the_fold, 3, backend=backend, launcher=launcher,
        deterministic=deterministic, kwargs={"counts": [2, 1, 3]},
    )  # fmt: skip
    assert [r["value"] for r in reports] == [4] * 3


@pytest.mark.parametrize(
    ("backend", "launcher"),
    [pytest.param("gloo", "spawn", marks=GLOO), pytest.param("mpi", "mpiexec", marks=MPI)],
)
def test_mesh_subgroups(backend: str, launcher: str) -> None:
    reports = run_on_ranks(
        rank_bodies.mesh_subgroups, 4, backend=backend, launcher=launcher, kwargs={"tp": 2}
    )
    assert [r["value"] for r in reports] == [
        [0, 2, 0, 2], [1, 2, 0, 2], [0, 2, 1, 2], [1, 2, 1, 2]
    ]  # fmt: skip


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_a_dead_rank_is_named_not_waited_for(backend: str, launcher: str, collective: str) -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 1") as info:
        run_on_ranks(rank_bodies.rank_one_dies, 3, backend=backend, launcher=launcher,
                     comm_timeout=60, timeout=120, kwargs={"collective": collective})  # fmt: skip
    assert time.monotonic() - start < 45, "took as long as a timeout: the death was not noticed"
    if launcher == "spawn":
        assert "zero-launch: rank 1 exited with code 3" in str(info.value)


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
def test_a_peer_that_never_arrives_times_out_with_a_named_error(
    backend: str, launcher: str
) -> None:
    """Rank 1 comes 6 s late to rank 0's collective of 3 s timeout; rank 0 then waits at
    exit for rank 1, alive, to let go of the store it hosts."""
    with pytest.raises(RanksFailed) as info:
        run_on_ranks(rank_bodies.rank_one_is_late, 2, backend=backend, launcher=launcher,
                     comm_timeout=3, timeout=90, kwargs={"late_s": 6})  # fmt: skip
    message = str(info.value)
    assert "CommTimeoutError" in message and "rank 0 timed out after" in message, message
    assert "[rank 0] all_reduce" in message, message


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
def test_a_failure_on_one_rank_fails_every_rank(backend: str, launcher: str) -> None:
    """The harness must not pass a test that failed on any rank (fairscale's old bug)."""
    with pytest.raises(RanksFailed) as info:
        run_on_ranks(rank_bodies.fails_on_last_rank, 3, backend=backend, launcher=launcher)
    message = str(info.value)
    assert "deliberate failure on the last rank" in message
    assert all(f"rank {r} failed" in message for r in range(3)), message


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
def test_a_rank_that_fails_to_initialise_fails_the_test(backend: str, launcher: str) -> None:
    """Promptly: under mpiexec nothing stops the peer waiting in the rendezvous, so the
    harness does, instead of waiting out the peer's 60 s communicator timeout."""
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"rank 1 failed:(.|\n)*deliberate import failure"):
        run_on_ranks(fails_to_import_on_rank_one.body, 2, backend=backend, launcher=launcher,
                     timeout=120, comm_timeout=60)  # fmt: skip
    assert time.monotonic() - start < 45


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
def test_barriers_async_waits_and_ring_volume_on_one_start(backend: str, launcher: str) -> None:
    """Barriers in both forms; two async all-reduces waited in opposite orders on odd and
    even ranks; the stats count one step's ring volume exactly; inputs dropped before the
    wait still arrive (one start of the ranks)."""
    numel, n = 1000, 3
    reports = run_on_ranks(rank_bodies.barriers_waits_and_stats, n, backend=backend,
                           launcher=launcher, kwargs={"numel": numel})  # fmt: skip
    buffer = numel * n
    for report in reports:
        value = report["value"]
        assert value["barriers"] == 2
        assert value["waits"] == [6.0, 303.0]
        assert value["dropped_inputs_arrive"]
        volume = value["volume"]
        assert volume["all_reduce"] == float(Fraction(2 * (n - 1) * buffer, n))
        assert volume["reduce_scatter"] == float(Fraction((n - 1) * buffer, n))
        assert volume["all_gather"] == float(Fraction((n - 1) * buffer, n))


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
def test_splits_of_subgroups_and_key_ties(backend: str, launcher: str) -> None:
    reports = run_on_ranks(rank_bodies.splits_of_splits, 4, backend=backend, launcher=launcher)
    sums = [0 + 2, 1 + 3, 0 + 2, 1 + 3]
    assert [r["value"] for r in reports] == [
        [1.0, float(sums[r]), float(3 - r), float(3 - r)] for r in range(4)
    ]


@pytest.mark.gloo
def test_closing_does_not_destroy_a_process_group_the_application_owns() -> None:
    code = (
        "import torch.distributed as dist, zero_comm\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, world_size=1)\n"
        "comm = zero_comm.init('gloo')\n"
        "comm.close()\n"
        "assert dist.is_initialized(), 'zero_comm destroyed the application group'\n"
        "dist.destroy_process_group()\n"
    )
    from zero_comm.launch import free_port

    subprocess.run([sys.executable, "-c", code % free_port()], check=True, timeout=60)


@pytest.mark.gloo
def test_a_dead_peer_is_an_error_even_without_a_launcher_to_stop_the_others() -> None:
    """Two ranks started by hand (no launcher kills anyone): rank 1 dies before a
    collective; rank 0 must raise a CommError (peer failure or timeout), not hang, and
    exit soon after: it hosts the store, and waits at exit only for ranks that may still
    use it (it waited out 10 s for the dead one before)."""
    from zero_comm.launch import free_port

    port = str(free_port())
    code = (
        "import os, sys, time, torch, zero_comm\n"
        "comm = zero_comm.init('gloo', timeout=5)\n"
        "comm.barrier()\n"
        "if comm.rank == 1: os._exit(0)\n"
        "try:\n"
        "    comm.all_reduce(torch.ones(100))\n"
        "finally:\n"
        "    print(f'RAISED AT {time.monotonic()}', file=sys.stderr, flush=True)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=dict(
                os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=60)
    exited = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this host
    procs[1].wait(timeout=60)
    assert procs[0].returncode != 0
    assert "PeerFailureError: [rank 0]" in err or "CommTimeoutError: [rank 0]" in err, err
    assert exited - start < 30, "rank 0 waited longer than its timeout"
    raised = float(next(x for x in err.splitlines() if x.startswith("RAISED AT ")).split()[-1])
    assert exited - raised < 5, f"rank 0 took {exited - raised:.1f}s to exit after its error"


@pytest.mark.gloo
def test_rendezvous_names_the_ranks_that_never_arrive() -> None:
    """Rank 0 of a world of 3 is started alone: it must name ranks 1 and 2, in time."""
    from zero_comm.launch import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))  # fmt: skip
    code = "import zero_comm; zero_comm.init('gloo', timeout=2)"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode != 0
    assert "CommTimeoutError" in result.stderr
    assert "[rank 0] rendezvous: ranks [1, 2] of 3 did not arrive within 2" in result.stderr
    assert time.monotonic() - start < 30


@pytest.mark.gloo
def test_a_rank_whose_rendezvous_host_is_unreachable_gets_a_named_error() -> None:
    from zero_comm.launch import free_port

    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))  # fmt: skip
    code = "import zero_comm; zero_comm.init('gloo', timeout=2)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode != 0
    assert "[rank 1] could not reach the rendezvous store at 127.0.0.1" in result.stderr


@pytest.mark.parametrize(("backend", "launcher"), FAILURE_WORLDS)
@pytest.mark.parametrize("mode", ["every", "digest"])
def test_a_divergence_after_warm_up_is_named_on_every_rank(
    backend: str, launcher: str, mode: str
) -> None:
    """Every rank raises CollectiveMismatchError naming each rank's call, at once. With
    "digest" a call is compared while its context (the 8 calls before it) is new: the
    first 8 + 3 calls here; the fifth step compares nothing."""
    reports = run_on_ranks(rank_bodies.diverges_after_warm_up, 3, backend=backend,
                           launcher=launcher, comm_timeout=60, kwargs={"mode": mode})  # fmt: skip
    for rank, report in enumerate(r["value"] for r in reports):
        message = report["message"]
        assert message.startswith(f"[rank {rank}] all_gather #"), message
        # A label travels as a code: a rank that never used 'layer 1' prints its code.
        theirs = "'layer 1'" if rank == 1 else "'label#"
        assert f"rank 1: all_gather(float32, numel=16, {theirs}" in message, message
        assert "rank 0: all_gather(float32, numel=16, 'layer 0')" in message, message
        assert report["after_s"] < 10, report
        expected = [3, 3, 3, 3, 3] if mode == "every" else [3, 3, 3, 2, 0]
        assert report["compared"] == expected, report
