"""What the consistency check costs a training step: "every", "digest" and "off", interleaved.

    zero-launch -n 2 python -m tools.micro.consistency --backend gloo
    mpiexec -n 2 python -m mpi4py -m tools.micro.consistency --backend mpi

A stage-3 engine over ``--layers`` x Linear(width, width) takes one step per mode in turn
(rounds after ``--warmup`` are timed, between barriers); rank 0 prints each mode's median
step time, its ratio to "off", and the calls compared per step in the last round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import zero_comm
import zero_core

MODES = ("every", "digest", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = zero_comm.init(args.backend, deterministic=True)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    config = zero_core.ZeroConfig(stage=3, persistence_threshold=0)
    engine = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-4), config, comm)
    batch = torch.randn(8, args.width)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    compared = dict.fromkeys(MODES, 0)
    for round_ in range(args.rounds):
        for mode in MODES:
            comm.check_consistency = mode
            comm.barrier()
            before = comm.compared_calls
            started = time.perf_counter()
            engine.backward(engine(batch).square().mean())
            engine.step()
            comm.barrier()
            if round_ >= args.warmup:
                times[mode].append(time.perf_counter() - started)
            compared[mode] = comm.compared_calls - before
    if comm.rank == 0:
        off = statistics.median(times["off"])
        timed = args.rounds - args.warmup
        print(f"{args.backend}, {comm.world_size} ranks, stage 3, {args.layers} x "
              f"Linear({args.width}, {args.width}), medians of {timed} steps")  # fmt: skip
        for mode in MODES:
            median = statistics.median(times[mode])
            print(f"  {mode:7s} {median * 1e3:8.1f} ms  {median / off:5.2f}x off  "
                  f"{compared[mode]} calls compared per step (last round)")  # fmt: skip
    comm.close()


if __name__ == "__main__":
    main()
