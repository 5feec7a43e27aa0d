"""One rank of a 2-rank gloo job in which one rank stops, lags, leaves or dies while the
other waits in a collective (test_peer_faults.py starts both by hand: no launcher).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python peer_fault_rank.py CASE DIR HB
    mpiexec -n 2 python -m mpi4py peer_fault_rank.py CASE DIR HB mpi

CASE (HB: the heartbeat timeout in seconds; the collective timeout is 120 s, far beyond):

    slow    rank 1 sleeps 3 * HB in Python (its heartbeat beats) before joining the
            all-reduce: rank 0 completes it, no error
    stop    rank 1 stops itself (SIGSTOP) while rank 0 waits for it in the all-reduce:
            rank 0 names it as stopped (an all-reduce issued before the stop is no good:
            rank 1's gloo thread may complete its part of it before the stop lands)
    (both without the digest check, so that rank 0 waits in gloo's own wait)
    leave   rank 1's script ends (exit 0) while rank 0 waits in an all-reduce at a new place
            (the digest check's store wait)
    kill0   rank 0 SIGKILLs itself while rank 1 waits: rank 1 names rank 0 and its store
    leave1  rank 1 leaves as zero-train's rank out of memory does (comm.leave(why), then
            os._exit) while rank 0 waits in the digest check's store wait: rank 0 names
            it, and why
    kill1   rank 1 SIGKILLs itself (the kernel's OOM killer) while rank 0 waits in the
            digest check's store wait, which the store rank 0 hosts outlives: rank 0
            names it as dead (/proc), not as silent after the heartbeat timeout

The victim writes the time, what it did and its pid to DIR/event just before. The rank that waits
prints one JSON line {"rank", "error", "after_s"} on stdout (after_s: from the event to
the error) and its error's message, as one line, on stderr, as zero-train does, and exits
3; without an error it prints {"rank", "error": null} and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import zero_comm


def event(folder: Path, what: str) -> None:
    (folder / "event").write_text(f"{time.time()!r} {what} {os.getpid()}")


def main() -> int:
    case, folder, heartbeat = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    backend = sys.argv[4] if len(sys.argv) > 4 else "gloo"
    comm = zero_comm.init(
        backend,
        timeout=120.0,
        heartbeat_timeout=heartbeat,
        check_consistency="digest" if case not in ("stop", "slow") else False,  # gloo waits
    )
    x = torch.ones(1 << 10)
    comm.all_reduce(x)  # every rank is up, and has beaten
    victim = 0 if case == "kill0" else 1
    if comm.rank == victim:
        if case == "slow":
            time.sleep(3 * heartbeat)
        elif case == "stop":
            time.sleep(0.5)  # rank 0 is waiting for it in the all-reduce by now
            event(folder, "stopped")
            os.kill(os.getpid(), signal.SIGSTOP)
            return 0
        elif case == "leave":
            time.sleep(0.5)  # rank 0 is waiting by now
            event(folder, "left")
            return 0
        elif case in ("kill0", "kill1"):
            time.sleep(0.5)
            event(folder, "killed")
            os.kill(os.getpid(), signal.SIGKILL)
        elif case == "leave1":
            time.sleep(0.5)
            event(folder, "left")
            comm.leave("it ran out of memory in a test")
            os._exit(71)
    try:
        comm.all_reduce(x)
    except zero_comm.CommError as exc:
        happened = float((folder / "event").read_text().split()[0])
        report = {"rank": comm.rank, "error": type(exc).__name__, "after_s": time.time() - happened}
        print(json.dumps(report), flush=True)
        print(f"zero-comm: {exc}", file=sys.stderr, flush=True)
        return 3
    assert x.eq(4).all(), x  # two all-reduces of ones over 2 ranks
    print(json.dumps({"rank": comm.rank, "error": None}), flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
