"""One rank of a training job in which rank ``--victim`` kills itself (SIGKILL) at step 3.

    python tests/fault_rank.py --where backward --folder DIR          (under a launcher)

Every rank trains a small MLP at ZeRO stage 3 (so forward and backward communicate),
saving a checkpoint to DIR/ckpt after each step. At step 3 the victim dies:

    forward     as layer 1's forward starts
    backward    as backward reaches layer 1's output
    collective  right after it issued an all-gather, before waiting for it
    step        as the optimizer step starts
    save        after writing its checkpoint shard, before the save completes
    swap        inside the disk pipeline of the optimizer step: once the swap write of
                its 3rd disk tile's ``exp_avg`` has landed, while that tile's other
                writes and the next tiles' reads are in flight
    grad_swap   in backward, mid-swap of gradients: once its 3rd disk tile's gradient
                block has been written (the gradient tier writes each tile's block as its
                bucket's reduced slice lands), while other buckets' reduce-scatters are
                in flight and the remaining tiles' gradients are not written yet

For ``swap`` and ``grad_swap`` every rank keeps its masters, optimizer states, gradients
and parameter shards on disk (offload_optimizer and offload_params "disk", gradients
following the optimizer's tier, swap files under DIR/swap, tiles of SWAP_TILE_NUMEL
elements: each rank's ~5,500 elements make 6 tiles or more); the victim's swap files stay
behind, half written.

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
from zero_core.component_access import disk_swap, sharded_parameters

WHERE = ("forward", "backward", "collective", "step", "save", "swap", "grad_swap")
ON_DISK = ("swap", "grad_swap")  # the disk tiers' points
KILL_STEP = 3
SWAP_TILE_NUMEL = 1024  # elements per disk tile (offload_sub_group_numel)
SWAP_KILL_TILE = 2  # the victim dies in the write of its 3rd disk tile
SWAP_KILL_KEY = {"swap": "exp_avg", "grad_swap": "gradient"}  # the block it dies after


def build(comm: zero_comm.Communicator, offload_dir: Path | None = None) -> zero_core.ZeroEngine:
    """The job's engine: stage 3, everything on the device, or with ``offload_dir`` the
    masters, optimizer states and parameter shards in swap files under it."""
    tiers: dict[str, Any] = {}
    if offload_dir is not None:
        offload_dir.mkdir(parents=True, exist_ok=True)
        tiers = {
            "offload_optimizer": "disk",
            "offload_params": "disk",
            "offload_dir": str(offload_dir),
            "offload_sub_group_numel": SWAP_TILE_NUMEL,
        }
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return zero_core.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero_core.ZeroConfig(stage=3, persistence_threshold=0, **tiers),
        comm,
    )


def train_step(engine: zero_core.ZeroEngine, step: int) -> None:
    comm = engine.comm
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 100 + comm.rank))
    engine.backward(engine(x).square().mean())
    engine.step()


def expected_state(
    comm: zero_comm.Communicator, steps: int, folder: Path | None, offload_dir: Path | None = None
) -> Any:
    """After loading ``folder`` (if given), train up to ``steps``; the full state. With
    ``offload_dir``, on the disk tiers (``build``)."""
    engine = build(comm, offload_dir)
    first = engine.load(folder)["steps"] if folder is not None else 0
    for step in range(first, steps):
        train_step(engine, step)
    state = engine.full_state_dict()
    engine.close()
    return state


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
        gatherer: Any = sharded_parameters(engine).gatherer
        # The one method that issues every gather (alone or coalesced); a hook on a name
        # the gatherer no longer calls left this rank alive, and the test failing.
        start = gatherer._start_gathers

        def start_then_die(units: Any) -> None:
            start(units)
            die(folder)

        gatherer._start_gathers = start_then_die
    elif where == "step":
        engine.optimizer.register_step_pre_hook(lambda *_: die(folder))
    elif where == "save":
        from zero_core.checkpoint import writer as checkpoint

        write = checkpoint.write_stream

        def write_then_die(*args: Any, **kwargs: Any) -> Any:
            write(*args, **kwargs)
            die(folder)

        checkpoint.write_stream = write_then_die  # type: ignore[assignment]
    elif where in ON_DISK:
        swap: Any = disk_swap(engine)
        # The pipeline's threads and the gradient tier call the instance's attribute.
        swap_write = swap.write

        def swap_write_then_die(index: int, key: str, value: torch.Tensor) -> None:
            swap_write(index, key, value)
            if index == SWAP_KILL_TILE and key == SWAP_KILL_KEY[where]:
                die(folder)

        swap.write = swap_write_then_die


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
    engine = build(comm, args.folder / "swap" if args.where in ON_DISK else None)
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
