"""One of three ranks started by hand: rank 1 dies, and rank 2 exits with a collective of
its own still in flight, as a rank of a ZeRO step does after PeerFailureError.

    RANK=r WORLD_SIZE=3 MASTER_ADDR=... MASTER_PORT=... python exit_in_flight_rank.py DIR

Rank 1 SIGKILLs itself. Rank 2 issues a reduce-scatter on the subgroup {0, 2} and drops
its handle and tensors (a failing step drops its bucket reductions so), meets
PeerFailureError on the world, reports and exits 3. Rank 0 reports the same error, joins
that reduce-scatter while rank 2 exits, checks that the failed world communicator refuses
another collective and closes promptly, and exits 3.

Rank 2's last exit handler holds the GIL for two seconds (a C call run by atexit: no
bytecode in it lets the GIL go), and rank 0 joins meanwhile. A gloo worker thread that
frees the ended reduce-scatter then (its tensors' Python objects need the GIL) is still
waiting for the GIL when the interpreter starts finalizing, and Python ends it inside a C++
destructor: std::terminate, "terminate called without an active exception", SIGABRT. A
rank of a real job loses that race now and then; this one, every time, unless zero_comm
has let the reduce-scatter end, and kept it, before its exit handlers were done.

Each survivor prints one JSON line.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and os.environ.get("RANK") == "2":
    # Registered before torch's and zero_comm's exit handlers, so these run last: say so to
    # rank 0, then hold the GIL for 2 s (a function of a PyDLL keeps it while it runs).
    atexit.register(ctypes.PyDLL(None).usleep, 2_000_000)
    atexit.register((Path(sys.argv[1]) / "rank2-last").touch)

import torch

import zero_comm

N = 1000
# Where the communicators live until the interpreter finalizes (a training script's engine
# keeps them so, in reference cycles): their process groups, and so their worker threads,
# outlive the exit handlers.
KEPT: list[zero_comm.Communicator] = []


def main() -> int:
    folder = Path(sys.argv[1])
    # deterministic: a float reduce-scatter is an all-to-all, whose gloo work holds the very
    # tensors it was given (those whose Python objects go with the dropped handle).
    comm = zero_comm.init("gloo", deterministic=True, timeout=10.0, check_consistency=False)
    pair = comm.split(color=int(comm.rank == 1))  # ranks 0 and 2; rank 1 alone
    KEPT.extend((comm, pair))
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank == 2:
        pair.reduce_scatter(torch.empty(N), torch.full((2 * N,), 2.0), async_op=True)
    report: dict[str, Any] = {"rank": comm.rank}
    try:
        comm.all_reduce(torch.ones(N))
    except zero_comm.CommError as exc:
        report.update(error=type(exc).__name__, message=str(exc))
    if comm.rank == 0:
        # Rank 2 is exiting: join while its last exit handler holds the GIL, or 3 s after
        # its report (zero_comm waits for the reduce-scatter before that handler runs).
        deadline = time.monotonic() + 60
        while not (folder / "rank2-reported").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        deadline = time.monotonic() + 3
        while not (folder / "rank2-last").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        reduced = torch.empty(N)
        pair.reduce_scatter(reduced, torch.full((2 * N,), 1.0))
        report["reduced"] = reduced.unique().tolist()
        try:
            comm.barrier()
        except zero_comm.CommError as exc:
            report["then"] = str(exc)
        started = time.monotonic()
        comm.close()
        report["close_s"] = time.monotonic() - started
    print(json.dumps(report), flush=True)
    if comm.rank == 2:
        (folder / "rank2-reported").touch()
    return 3


if __name__ == "__main__":
    sys.exit(main())
