#!/usr/bin/env python
"""What ``ZeroConfig.reduce_dtype=float32`` costs a bf16 GPT step, against bf16 reduction.

    zero-launch -n 2 python -m tools.micro.reduce_dtype --json bench/reduce-dtype.json
    zero-launch -n 2 python -m tools.micro.reduce_dtype --stages 2 3 --width 256 --layers 4

A zero_models GPT (``--layers``, ``--width``, ``--heads``, ``--context``, byte vocabulary)
in bf16 with AdamW, one engine per (stage, reduce dtype) on its own communicator
(``comm.split``), each a deep copy of one model. Each rank feeds its own ``--batch``
sequences of random tokens (seeded by rank and step; every engine sees the same ones).

One step is ``engine.backward(cross_entropy(engine(tokens)))`` then ``engine.step()``,
timed from leaving a barrier on the world communicator to the end of ``step()``; a sample
is the slowest rank's. After ``--warmup`` steps each, ``--rounds`` rounds of one step per
engine, in an order that reverses every round so that the machine's drift hits every
engine alike. Reported per engine: the median, min and max step time; per stage, the
median over rounds of (float32 / bf16 step time in the same round), the paired ratio.

Memory and traffic come from the engine: ``memory_report().gradients`` just after a
backward (the gradient bytes held from backward to the step, the peak of that category)
and the reductions' bytes per step from the communicator's stats (ring convention).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from tools.common.provenance import git_head
from zero_models.gpt import GPT, GPTConfig

REDUCE_DTYPES = {"bf16": None, "fp32": torch.float32}
GRADIENT_COLLECTIVES = ("reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def step_seconds(engine: zero_core.ZeroEngine, tokens: torch.Tensor) -> float:
    """One training step on ``tokens`` (B, T): next-token cross-entropy, backward, step."""
    started = time.perf_counter()
    logits = engine(tokens[:, :-1])  # (B, T-1, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    engine.backward(loss)
    if not engine.step():
        raise RuntimeError("step() did not apply the update")
    return time.perf_counter() - started


def run_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    world = zero_comm.init("gloo", deterministic=True)
    config = GPTConfig(context=args.context, layers=args.layers, heads=args.heads,
                       width=args.width)  # fmt: skip
    base = GPT(config, seed=args.seed)
    numel = sum(p.numel() for p in base.parameters())
    names = [(stage, reduce) for stage in args.stages for reduce in REDUCE_DTYPES]
    engines = {}
    for stage, reduce in names:
        model = copy.deepcopy(base)
        zero = zero_core.ZeroConfig(stage=stage, param_dtype=torch.bfloat16,
                                    reduce_dtype=REDUCE_DTYPES[reduce])  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engines[stage, reduce] = zero_core.initialize(model, optimizer, zero, world.split(color=0))
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + world.rank)
    steps = args.warmup + args.rounds + 1
    batches = [
        torch.randint(0, config.vocab_size, (args.batch, args.context + 1), generator=generator)
        for _ in range(steps)
    ]
    for i in range(args.warmup):
        for key in names:
            world.barrier()
            step_seconds(engines[key], batches[i])
    for engine in engines.values():
        engine.comm.stats.reset()
    samples: dict[tuple[int, str], list[float]] = {key: [] for key in names}
    for r in range(args.rounds):
        for key in names if r % 2 == 0 else names[::-1]:
            world.barrier()
            samples[key].append(step_seconds(engines[key], batches[args.warmup + r]))
    slowest = {
        key: [max(column) for column in zip(*world.all_gather_object(mine), strict=True)]
        for key, mine in samples.items()
    }
    results = []
    for stage, reduce in names:
        engine = engines[stage, reduce]
        counts = engine.comm.stats.as_dict()
        reduced = sum(counts[op]["volume_bytes"] for op in GRADIENT_COLLECTIVES if op in counts)
        engine.backward(F.cross_entropy(
            engine(batches[-1][:, :-1]).float().flatten(0, 1), batches[-1][:, 1:].flatten()
        ))  # fmt: skip
        gradient_bytes = engine.memory_report().gradients
        engine.step()
        times = slowest[stage, reduce]
        bf16_times = slowest[stage, "bf16"]
        results.append({
            "stage": stage, "reduce_dtype": reduce,
            "median_step_s": statistics.median(times), "min_step_s": min(times),
            "max_step_s": max(times),
            "paired_ratio_to_bf16": statistics.median(
                a / b for a, b in zip(times, bf16_times, strict=True)
            ),
            "gradient_bytes_after_backward": gradient_bytes,
            "reduction_bytes_per_step": reduced / args.rounds,
        })  # fmt: skip
    if world.rank == 0:
        report = {
            "command": " ".join(sys.argv), "git_head": git_head(), "torch": torch.__version__,
            "world_size": world.world_size, "threads": torch.get_num_threads(),
            "parameters": numel, "model": vars(config) if hasattr(config, "__dict__") else {},
            "batch_per_rank": args.batch, "warmup": args.warmup, "rounds": args.rounds,
            "results": results,
        }  # fmt: skip
        print(markdown(report))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    for engine in engines.values():
        engine.close()
    world.close()


def markdown(report: dict[str, Any]) -> str:
    out = [
        f"bf16 GPT, {report['parameters'] / 1e6:.2f}M parameters, N={report['world_size']} "
        f"(gloo), {report['threads']} thread(s)/rank, batch {report['batch_per_rank']}/rank, "
        f"{report['rounds']} interleaved rounds after {report['warmup']} warm-up steps, git "
        f"{report['git_head']}\n",
        "| stage | reduce | step ms median (min-max) | fp32/bf16 paired | gradient MiB "
        "after backward | reduction MiB/step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        out.append(
            f"| {r['stage']} | {r['reduce_dtype']} | {1e3 * r['median_step_s']:.1f} "
            f"({1e3 * r['min_step_s']:.1f}-{1e3 * r['max_step_s']:.1f}) | "
            f"{r['paired_ratio_to_bf16']:.3f} | {r['gradient_bytes_after_backward'] / 2**20:.2f} "
            f"| {r['reduction_bytes_per_step'] / 2**20:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report here")
    run_rank(parser.parse_args())


if __name__ == "__main__":
    main()
