"""One of two ranks of a job in which rank 1 does not come to ``engine.save`` at once.

    python save_arrival_rank.py CASE FOLDER [ARRIVAL_TIMEOUT]     (RANK etc. from the test)

Both ranks build a small stage-2 engine and take one step; then rank 1

    exits       returns from the script without calling save (it checks out)
    late        sleeps LATE_S, then saves
    elsewhere   waits (alive and beating) until rank 0 has reported, at most
                ELSEWHERE_S, then exits

and rank 0 saves at once. Before its exit or sleep rank 1 writes the time to FOLDER/event.
Each rank prints one JSON line: {"rank", "error", "message", "seconds"} (the error's type
and text, "" after a save that completed; seconds from rank 1's event to the end).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import zero_comm
import zero_core

LATE_S = 2.0
ELSEWHERE_S = 30.0


def main(case: str, folder: Path, arrival_timeout: float) -> None:
    comm = zero_comm.init(backend="gloo")
    torch.manual_seed(0)
    engine = zero_core.initialize(
        nn.Linear(8, 4), torch.optim.SGD, zero_core.ZeroConfig(stage=2), comm,
        optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip
    engine.backward(engine(torch.ones(2, 8)).sum())
    engine.step()
    if comm.rank == 1:
        (folder / "event").write_text(str(time.time()))
        if case == "exits":
            return
        if case == "elsewhere":
            deadline = time.monotonic() + ELSEWHERE_S
            while not (folder / "reported").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        time.sleep(LATE_S)
    error, message = "", ""
    try:
        engine.save(folder / "ckpt", arrival_timeout=arrival_timeout)
    except Exception as exc:  # reported, not raised: the test reads it
        error, message = type(exc).__name__, str(exc)
    event = float((folder / "event").read_text())
    report = {"rank": comm.rank, "error": error, "message": message,
              "seconds": time.time() - event}  # fmt: skip
    print(json.dumps(report), flush=True)
    if comm.rank == 0:
        (folder / "reported").touch()


if __name__ == "__main__":
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    main(sys.argv[1], Path(sys.argv[2]), timeout)
