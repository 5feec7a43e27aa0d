"""One rank of a job in which rank 1 kills itself (SIGKILL) inside its delayed parameter
update (ZeroConfig.delayed_parameter_update), in the background thread, at step 3.

    python tests/delayed_update_fault_rank.py --folder DIR          (under a launcher)

Every rank trains a small MLP at stage 2 with its optimizer on the host and the update
delayed by one step. The victim's update of step 3 starts (the optimizer's step pre-hook,
in the update's thread), writes the time and its pid to DIR/killed_at and dies; the
survivor is then in step 4's forward and backward, whose collectives find the peer gone.
It prints one JSON line ``{"rank", "error", "message", "after_kill_s", "thread"}`` and
exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero_comm
import zero_core
from zero_comm.testing.threads import pin_test_threads

KILL_STEP = 3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    pin_test_threads()
    comm = zero_comm.init("gloo", deterministic=True, timeout=args.timeout)
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    engine = zero_core.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero_core.ZeroConfig(stage=2, offload_optimizer="cpu", delayed_parameter_update=True),
        comm,
    )
    killed = args.folder / "killed_at"

    def die(*_: Any) -> None:
        killed.write_text(f"{time.time()!r} {os.getpid()} {threading.current_thread().name}")
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        for step in range(8):
            if step == KILL_STEP - 1 and comm.rank == 1:
                engine.optimizer.register_step_pre_hook(die)  # step 3's update
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 100 + comm.rank))
            engine.backward(engine(x).square().mean())
            engine.step()
        engine.full_state_dict()
    except Exception as exc:
        after = time.time() - float(killed.read_text().split()[0]) if killed.exists() else None
        report = {"rank": comm.rank, "error": type(exc).__name__, "message": str(exc),
                  "after_kill_s": after}  # fmt: skip
        print(json.dumps(report), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
