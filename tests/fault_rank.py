"""One rank of a training job in which rank ``--victim`` kills itself (SIGKILL) at step 3.

    python tests/fault_rank.py --where backward --folder DIR          (under a launcher)

Every rank trains a small MLP at ZeRO stage 3 (so forward and backward communicate),
saving a checkpoint to DIR/ckpt after each step. At step 3 the victim dies:

    forward     as layer 1's forward starts
    backward    as backward reaches layer 1's output
    collective  right after it issued an all-gather, before waiting for it
    step        as the optimizer step starts
    save        after writing its checkpoint shard, before the save completes

Just before, it writes the time and its pid to DIR/killed_at. A surviving rank prints one JSON line
``{"rank", "error", "message", "after_kill_s"}`` and exits 3; the numbers of steps it
saw are in the checkpoint. ``expected_state`` is the same training without a fault.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero_comm
import zero_core
from zero_comm.testing.threads import pin_test_threads

WHERE = ("forward", "backward", "collective", "step", "save")
KILL_STEP = 3


def build(comm: zero_comm.Communicator) -> zero_core.ZeroEngine:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return zero_core.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero_core.ZeroConfig(stage=3, persistence_threshold=0),
        comm,
    )


def train_step(engine: zero_core.ZeroEngine, step: int) -> None:
    comm = engine.comm
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 100 + comm.rank))
    engine.backward(engine(x).square().mean())
    engine.step()


def expected_state(comm: zero_comm.Communicator, steps: int, folder: Path | None) -> Any:
    """After loading ``folder`` (if given), train up to ``steps``; the full state."""
    engine = build(comm)
    first = engine.load(folder)["steps"] if folder is not None else 0
    for step in range(first, steps):
        train_step(engine, step)
    return engine.full_state_dict()


def die(folder: Path) -> None:
    (folder / "killed_at").write_text(f"{time.time()!r} {os.getpid()}")
    os.kill(os.getpid(), signal.SIGKILL)


def arm(engine: zero_core.ZeroEngine, where: str, folder: Path) -> None:
    """Make this rank die at ``where`` (from now on)."""
    layer = engine.module[1]  # type: ignore[index]
    if where == "forward":
        layer.register_forward_pre_hook(lambda *_: die(folder))
    elif where == "backward":
        layer.register_forward_hook(
            lambda _m, _i, out: out.register_hook(lambda g: die(folder)) and None
        )
    elif where == "collective":
        gatherer: Any = engine.parameters.gatherer  # type: ignore[attr-defined]
        start = gatherer._start_gather

        def start_then_die(unit: Any) -> None:
            start(unit)
            die(folder)

        gatherer._start_gather = start_then_die
    elif where == "step":
        engine.optimizer.register_step_pre_hook(lambda *_: die(folder))
    elif where == "save":
        from zero_core import checkpoint

        write = checkpoint.write_file

        def write_then_die(*args: Any, **kwargs: Any) -> Any:
            write(*args, **kwargs)
            die(folder)

        checkpoint.write_file = write_then_die  # type: ignore[assignment]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=WHERE, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    pin_test_threads()  # the test compares with its own run: the same thread count
    comm = zero_comm.init(args.backend, deterministic=True, timeout=args.timeout)
    engine = build(comm)
    try:
        for step in range(6):
            if step == KILL_STEP and comm.rank == args.victim:
                arm(engine, args.where, args.folder)
            train_step(engine, step)
            engine.save(args.folder / "ckpt", extra={"steps": step + 1})
    except Exception as exc:
        killed = args.folder / "killed_at"
        after = time.time() - float(killed.read_text().split()[0]) if killed.exists() else None
        report = {"rank": comm.rank, "error": type(exc).__name__, "message": str(exc),
                  "after_kill_s": after}  # fmt: skip
        print(json.dumps(report), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
