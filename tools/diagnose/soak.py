#!/usr/bin/env python
"""Soak: a long zero-train run, twice; memory and step time must stay flat, bits equal.

    python -m tools.diagnose.soak --steps 2000 --nproc 4 --out runs/soak       (nox -s soak)

Runs ``zero-train --stage 3`` with a small GPT for ``--steps`` steps on ``--nproc`` local
ranks, twice with the same seed, each saving a checkpoint at the end. From each run's
metrics.jsonl it reports, per rank, the median resident memory and the median step time
(slowest rank) over the first 100 steps, over the 100 steps after a warm-up of
``--warmup-steps`` (the allocator and Python's caches grow during the first hundred
steps), and over the last 100 steps; then it compares the two runs: every loss, and every
parameter and optimizer state of the final checkpoints, must be bit-identical. Exits
non-zero when a rank's memory grew from the post-warm-up window to the last by more than
``--max-rss-growth-mib``, the step time by more than ``--max-time-growth``, or the runs
differ. Writes ``OUT/soak.md``. ``--report-only`` re-reads runs already in OUT.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint.consolidate import SavedModel
from zero_models.run_metrics import read_metrics


def run(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "zero_models.train", "--model", args.model, "--stage", "3",
               "--nproc", str(args.nproc), "--steps", str(args.steps), "--save-every",
               str(args.steps), "--sample-tokens", "8", "--out", str(out),
               "--overwrite"]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(out / "metrics.jsonl")[1]


def window(records: list[dict[str, Any]], start: int, size: int) -> dict[str, Any]:
    """Per-rank median RSS and the median slowest-rank step time of one window."""
    chosen = records[start : start + size]
    ranks = len(chosen[0]["rss_mib"])
    return {
        "rss_mib": [statistics.median(r["rss_mib"][k] for r in chosen) for k in range(ranks)],
        "step_s": statistics.median(r["step_s"] for r in chosen),
    }


def same_checkpoints(a: Path, b: Path) -> bool:
    left, right = SavedModel(a), SavedModel(b)
    keys = [n.split(".", 2)[2] for n in left.file_of(0).names if n.startswith("state.0.")]
    for g, i, _, _ in left.parameters():
        for what in ["master", *keys]:
            if not torch.equal(left.parameter(g, i, what), right.parameter(g, i, what)):
                return False
    return bool(left.index["groups"] == right.index["groups"])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="test")
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--max-rss-growth-mib", type=float, default=8.0)
    parser.add_argument("--max-time-growth", type=float, default=1.25)
    args = parser.parse_args()
    if args.report_only:
        first, second = (
            read_metrics(args.out / run / "metrics.jsonl")[1] for run in ("run1", "run2")
        )
    else:
        first = run(args, args.out / "run1")
        second = run(args, args.out / "run2")
    size = args.window
    start, settled, end = (
        window(first, at, size) for at in (0, args.warmup_steps, len(first) - size)
    )
    losses_equal = [r["loss"] for r in first] == [r["loss"] for r in second]
    states_equal = same_checkpoints(args.out / "run1/checkpoint", args.out / "run2/checkpoint")
    lines = [
        f"# Soak: zero-train --model {args.model} --stage 3, {args.nproc} ranks, "
        f"{len(first)} steps, run twice\n",
        f"Medians over windows of {size} steps: the first, the one after {args.warmup_steps} "
        "warm-up steps, and the last.\n",
        "| rank | RSS first MiB | RSS after warm-up MiB | RSS last MiB | growth after warm-up |",
        "|---:|---:|---:|---:|---:|",
    ]
    grew = False
    columns = zip(start["rss_mib"], settled["rss_mib"], end["rss_mib"], strict=True)
    for rank, (a, b, c) in enumerate(columns):
        lines.append(f"| {rank} | {a:.1f} | {b:.1f} | {c:.1f} | {c - b:+.1f} MiB |")
        grew |= c - b > args.max_rss_growth_mib
    t0, t1, t2 = start["step_s"], settled["step_s"], end["step_s"]
    slower = t2 > args.max_time_growth * t1
    lines += [
        f"\nStep time (slowest rank): {t0 * 1e3:.1f} ms first, {t1 * 1e3:.1f} ms after warm-up, "
        f"{t2 * 1e3:.1f} ms last ({t2 / t1:.2f}x).",
        f"Second run bit-identical: losses {losses_equal}, final parameters and optimizer "
        f"states {states_equal}.",
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "soak.md").write_text(text)
    print(text)
    return 0 if losses_equal and states_equal and not grew and not slower else 1


if __name__ == "__main__":
    sys.exit(main())
