#!/usr/bin/env python
"""What the engine's ``zero::`` profiler ranges cost when no profiler records: the step
time of a small GPT at stage 3 on one simulated rank, in small buckets (many units,
collectives and so ranges per step), for the code on ``PYTHONPATH``.

    python -m tools.micro.ranges --steps 200                  # this checkout
    OLD=<checkout without the ranges>/packages
    PYTHONPATH=$OLD/zero-comm/src:$OLD/zero-core/src:$OLD/zero-models/src \\
        python -m tools.micro.ranges --steps 200

Alternate the two a few times and compare the medians (docs/step-profile.md, last
section). One simulated rank, one thread: the engine's Python work with no wait for a
peer, where a range's cost shows most. Prints one JSON line: per-step wall and main-thread
CPU milliseconds, median and minimum, and which zero_core ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.nn import functional as F

import zero_core
from zero_comm import Communicator, run_simulated
from zero_models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, context=32, layers=4, heads=2, width=64)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bucket-numel", type=int, default=4096)
    p.add_argument("--prefetch-numel", type=int, default=8192)
    args = p.parse_args()
    torch.set_num_threads(1)

    def body(comm: Communicator) -> tuple[list[float], list[float]]:
        model = GPT(CONFIG, seed=0)
        config = zero_core.ZeroConfig(stage=args.stage, bucket_numel=args.bucket_numel,
                                      prefetch_numel=args.prefetch_numel)  # fmt: skip
        engine = zero_core.initialize(model, torch.optim.AdamW(model.parameters()), config, comm)
        tokens = torch.randint(0, 256, (2, CONFIG.context + 1),
                               generator=torch.Generator().manual_seed(0))  # fmt: skip
        wall, cpu = [], []
        for index in range(args.warmup + args.steps):
            started, cpu_started = time.perf_counter(), time.thread_time()
            logits = engine(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, 256), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            if index >= args.warmup:
                wall.append(time.perf_counter() - started)
                cpu.append(time.thread_time() - cpu_started)
        engine.close()
        return wall, cpu

    wall, cpu = run_simulated(1, body)[0]
    print(json.dumps({
        "wall_median_ms": 1e3 * statistics.median(wall), "wall_min_ms": 1e3 * min(wall),
        "cpu_median_ms": 1e3 * statistics.median(cpu), "cpu_min_ms": 1e3 * min(cpu),
        "zero_core": zero_core.__file__,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
