#!/usr/bin/env python
"""Memory per rank by ZeRO stage, predicted and measured, as the paper's Figure 1 draws it.

    MALLOC_MMAP_THRESHOLD_=65536 python -m tools.diagnose.memory_chart --out docs/zero-r-memory

Runs zero_models.memory_probe on 2 real gloo ranks for every stage (0-3), activation
checkpoint mode (none, full, partitioned) and tensor-parallel degree (1: 2 data-parallel
ranks; 2: one tensor-parallel pair), with the "small" GPT preset, float32, AdamW, 32
sequences of 128 tokens per rank. Writes OUT/memory-table.md (every row: model states and
activation peak, predicted and measured, and the checkpoint bytes kept) and
OUT/memory-by-stage.png: for TP 1 without checkpointing, one pair of stacked bars per stage,
the prediction (model states from the paper's formula + activations from
zero_core.estimate.activations) beside the measured peak.

Set MALLOC_MMAP_THRESHOLD_ as above: glibc then maps each allocation over 64 KiB on its
own, so a freed tensor leaves the resident set at once and the measured peak is tensors,
not heap that glibc kept (see zero_core.memory.tracker).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tools.common.provenance import git_head
from zero_comm.testing import run_on_ranks
from zero_models import memory_probe

MIB = 2**20
STATES, ACTIVATIONS, MEASURED = "tab:blue", "tab:orange", "tab:green"


def measure(stage: int, mode: str, tp: int, batch: int) -> dict[str, Any]:
    reports = run_on_ranks(
        memory_probe.train_and_measure, 2, timeout=600,
        kwargs={"preset": "small", "batch": batch, "stage": stage, "mode": mode, "tp": tp},
    )  # fmt: skip
    return max((r["value"] for r in reports), key=lambda v: v["measured"])


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars per stage: predicted (model states, activations and buffers) beside
    measured (model states counted, the rest of the peak)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(9.6, 5.4), constrained_layout=True)
    stages = [r["stage"] for r in rows]
    left = [s - 0.2 for s in stages]
    right = [s + 0.2 for s in stages]
    predicted_states = [r["states_predicted"] / MIB for r in rows]
    counted_states = [r["states_counted"] / MIB for r in rows]
    axis.bar(left, predicted_states, 0.38, color=STATES, label="model states")
    axis.bar(left, [r["predicted"] / MIB - p for r, p in zip(rows, predicted_states, strict=True)],
             0.38, bottom=predicted_states, color=ACTIVATIONS,
             label="activations, buffers: predicted")  # fmt: skip
    axis.bar(right, counted_states, 0.38, color=STATES)
    axis.bar(right, [r["measured"] / MIB - c for r, c in zip(rows, counted_states, strict=True)],
             0.38, bottom=counted_states, color=MEASURED, label="measured")  # fmt: skip
    axis.set_xticks(stages, [f"stage {s}" for s in stages])
    axis.set_ylabel("MiB per rank")
    axis.set_title("memory per rank by stage: predicted (left) and measured (right)")
    axis.legend()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/zero-r-memory"))
    parser.add_argument("--batch", type=int, default=32, help="sequences of 128 per rank")
    args = parser.parse_args()
    torch.set_num_threads(1)  # each rank's, through run_on_ranks: the table's figures were
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tp in (1, 2):
        for mode in ("none", "full", "partitioned"):
            if tp == 1 and mode == "partitioned":
                continue  # the same as full with one tensor-parallel rank
            for stage in (0, 1, 2, 3):
                row = {"tp": tp, "mode": mode, "stage": stage,
                       **measure(stage, mode, tp, args.batch)}  # fmt: skip
                rows.append(row)
                print(f"tp {tp} {mode:11s} stage {stage}: predicted {row['predicted'] / MIB:7.1f}"
                      f" measured {row['measured'] / MIB:7.1f} MiB", flush=True)  # fmt: skip
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "(unset)")
    flags = " ".join(sys.argv[1:])
    command = f"MALLOC_MMAP_THRESHOLD_={threshold} python -m tools.diagnose.memory_chart {flags}"
    lines = [
        "# Memory per rank: stage x activation checkpointing x tensor parallelism",
        "",
        f'`{command}` at {git_head()}; GPT preset "small" '
        f"(4 x 128, 256 tokens), float32, AdamW, {args.batch} x 128 tokens per rank, 2 gloo "
        "ranks (TP 1: 2 data-parallel ranks; TP 2: one tensor-parallel pair, 1 data-parallel "
        "rank). Measured: the last of 3 steps, the larger of the two ranks.",
        "",
        "| TP | checkpoints | stage | model states MiB (formula / counted) | checkpoints kept MiB "
        "| step peak MiB predicted | measured | ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kept = "-" if r["kept"] is None else f"{r['kept'] / MIB:.2f}"
        lines.append(
            f"| {r['tp']} | {r['mode']} | {r['stage']} | {r['states_predicted'] / MIB:.2f} / "
            f"{r['states_counted'] / MIB:.2f} | {kept} | {r['predicted'] / MIB:.1f} | "
            f"{r['measured'] / MIB:.1f} | {r['predicted'] / r['measured']:.3f} |"
        )
    (args.out / "memory-table.md").write_text("\n".join(lines) + "\n")
    draw(
        [r for r in rows if r["tp"] == 1 and r["mode"] == "none"], args.out / "memory-by-stage.png"
    )
    print(f"wrote {args.out / 'memory-table.md'} and {args.out / 'memory-by-stage.png'}")


if __name__ == "__main__":
    main()
