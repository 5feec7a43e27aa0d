"""One rank of a 2-rank job whose world someone else made (test_adopt.py starts both by
hand, torchrun-style variables; or mpiexec for ``mpi``):

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python adopt_rank.py CASE DIR
    mpiexec -n 2 python -m mpi4py adopt_rank.py mpi DIR

CASE:

    fresh     zero_comm.init(deterministic=True) makes the world: the reference bits
    adopted   the script calls torch.distributed.init_process_group("gloo") itself, then
              adopts the default group (from_process_group()), lets zero_comm.init()
              adopt it too, and adopts a new_group of both ranks and one of both in
              swapped order; each runs the same collectives, and the digest check must
              name a mismatched call; adopting a group of rank 1 alone raises on rank 0
    kill      adopted as above; rank 1 SIGKILLs itself while rank 0 waits for it in an
              all-reduce: rank 0 must name it dead (/proc, through the peers gathered)
    leave     the same, but rank 1's script ends (exit 0): rank 0 must name it as having
              left (its heartbeat's check-out), well before the collective timeout
    mpi       adopts a Split of MPI.COMM_WORLD with from_mpi_comm and runs the collectives

Each communicator's results go to DIR/<name>-<rank>.pt (name: fresh, world, init, sub,
swapped, mpi); the rank prints one JSON line of facts on stdout (``mpi``: writes it to
DIR/mpi-report-<rank>.json) and exits 0, or 3 with the error.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zero_comm

# The kill case's all-reduces at one call site: past the digest check's window of calls
# (call_schedule.WINDOW), the last is predicted, so rank 0 waits in gloo itself.
STEPS = 12


def collectives(comm: zero_comm.Communicator) -> dict[str, torch.Tensor]:
    """Deterministic SUMs and data movement on inputs that differ per rank (awkward sizes)."""
    g = torch.Generator().manual_seed(1234 + comm.rank)
    out: dict[str, torch.Tensor] = {}
    x = torch.randn(1003, generator=g)
    comm.all_reduce(x)
    out["all_reduce"] = x
    half = torch.randn(1001, generator=g).to(torch.bfloat16)
    comm.all_reduce(half)
    out["all_reduce_bf16"] = half
    shard = torch.empty(501)
    comm.reduce_scatter(shard, torch.randn(501 * comm.world_size, generator=g))
    out["reduce_scatter"] = shard
    gathered = torch.empty(7 * comm.world_size)
    comm.all_gather(gathered, torch.randn(7, generator=g))
    out["all_gather"] = gathered
    b = torch.randn(13, generator=g)
    comm.broadcast(b, src=comm.world_size - 1)
    out["broadcast"] = b
    return out


def facts(comm: zero_comm.Communicator) -> dict[str, Any]:
    return {
        "rank": comm.rank,
        "world_size": comm.world_size,
        "backend": comm.backend,
        "device": str(comm.device),
        "deterministic": comm.deterministic,
        "timeout": comm.timeout,
        "peers": [list(p) for p in comm.peers or []],
        "heartbeat": getattr(comm, "_heartbeat", None) is not None,
        "topology": list(comm.topology.node_of),
        "topology_source": comm.topology.source,
    }


def mismatch_named(comm: zero_comm.Communicator) -> str:
    """The digest check's error for a call of a different size on each rank ("" if none)."""
    try:
        comm.all_reduce(torch.ones(4 + comm.rank))
    except zero_comm.CollectiveMismatchError as exc:
        return str(exc)
    return ""


def init_torch() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def main() -> int:
    case, folder = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    report: dict[str, Any] = {"case": case}
    if case == "fresh":
        comm = zero_comm.init(deterministic=True, timeout=60.0)
        torch.save(collectives(comm), folder / f"fresh-{comm.rank}.pt")
        report["fresh"] = facts(comm)
        comm.close()
    elif case == "adopted":
        init_torch()
        world = zero_comm.from_process_group(timeout=45.0)
        again = zero_comm.init(deterministic=True, timeout=50.0)
        sub = zero_comm.from_process_group(dist.new_group([0, 1]), heartbeat_timeout=20.0)
        # Group rank 0 is world rank 1: not the world in world order, nor the store's host.
        swapped = zero_comm.from_process_group(dist.new_group([1, 0], sort_ranks=False))
        only_one = dist.new_group([1])
        try:
            alone = zero_comm.from_process_group(only_one)
            report["alone"] = facts(alone)
            alone.close()
        except ValueError as exc:
            report["not_a_member"] = str(exc)
        for name, comm in (("world", world), ("init", again), ("sub", sub), ("swapped", swapped)):
            torch.save(collectives(comm), folder / f"{name}-{comm.rank}.pt")
            report[name] = facts(comm)
        report["mismatch"] = mismatch_named(world)
        for comm in (swapped, sub, again, world):
            comm.close()
        report["still_initialised"] = dist.is_initialized()
        dist.destroy_process_group()
    elif case in ("kill", "leave"):
        init_torch()
        comm = zero_comm.from_process_group(timeout=45.0, heartbeat_timeout=10.0)
        x = torch.ones(1 << 10)
        started = time.monotonic()
        try:
            # gloo's connection to the killed rank closes; /proc names it dead.
            for step in range(STEPS):
                if step == STEPS - 1 and comm.rank == 1:
                    time.sleep(0.5)  # rank 0 waits for it in this all-reduce by now
                    if case == "leave":
                        return 0  # its heartbeat checks out as the interpreter exits
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
                comm.all_reduce(x)
        except zero_comm.CommError as exc:
            report.update(error=type(exc).__name__, message=str(exc))
            report["after_s"] = time.monotonic() - started
        print(json.dumps(report), flush=True)
        return 3 if "error" in report else 0
    elif case == "mpi":
        from mpi4py import MPI

        mine = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
        comm = zero_comm.from_mpi_comm(mine, timeout=45.0)
        torch.save(collectives(comm), folder / f"mpi-{comm.rank}.pt")
        report["mpi"] = facts(comm)
        report["mismatch"] = mismatch_named(comm)
        comm.close()
        report["still_usable"] = mine.allreduce(1) == 2  # the caller's communicator lives
        # A file per rank: two ranks' lines on mpiexec's one stdout may interleave.
        (folder / f"mpi-report-{mine.Get_rank()}.json").write_text(json.dumps(report))
    else:
        raise SystemExit(f"unknown case {case!r}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
