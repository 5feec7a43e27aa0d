#!/usr/bin/env python
"""Memory per rank by ZeRO stage, predicted and measured, as the paper's Figure 1 draws it.

    MALLOC_MMAP_THRESHOLD_=65536 python tools/memory_chart.py --out docs/zero-r-memory

Runs zero_models.memory_probe on 2 real gloo ranks for every stage (0-3), activation
checkpoint mode (none, full, partitioned) and tensor-parallel degree (1: 2 data-parallel
ranks; 2: one tensor-parallel pair), with the "small" GPT preset, float32, AdamW, 32
sequences of 128 tokens per rank. Writes OUT/memory-table.md (every row: model states and
activation peak, predicted and measured, and the checkpoint bytes kept) and
OUT/memory-by-stage.png: for TP 1 without checkpointing, one pair of stacked bars per stage,
the prediction (model states from the paper's formula + activations from
zero_core.activation_estimate) beside the measured peak.

Set MALLOC_MMAP_THRESHOLD_ as above: glibc then maps each allocation over 64 KiB on its
own, so a freed tensor leaves the resident set at once and the measured peak is tensors,
not heap that glibc kept (see zero_core.memory_tracker).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from provenance import git_head

from zero_comm.testing import run_on_ranks
from zero_models import memory_probe
from zero_models.loss_plot import AXIS_RGB, TEXT_RGB, _Canvas, _text_width, png_bytes

MIB = 2**20
STATES_RGB, ACTIVATIONS_RGB, MEASURED_RGB = (31, 119, 180), (255, 127, 14), (44, 160, 44)


def measure(stage: int, mode: str, tp: int, batch: int) -> dict[str, Any]:
    reports = run_on_ranks(
        memory_probe.train_and_measure, 2, timeout=600,
        kwargs={"preset": "small", "batch": batch, "stage": stage, "mode": mode, "tp": tp},
    )  # fmt: skip
    return max((r["value"] for r in reports), key=lambda v: v["measured"])


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars: predicted (states, activations) and measured (states, the rest)."""
    width, height, s = 960, 540, 2
    canvas = _Canvas(width, height)
    top = max(max(r["predicted"], r["measured"]) for r in rows)
    x0, y0, y1 = 60 * s // 2, 40, height - 60
    scale = (y1 - y0) / top

    def bar(x: int, parts: list[tuple[float, tuple[int, int, int]]]) -> None:
        y = y1
        for value, rgb in parts:
            h = round(value * scale)
            canvas.rect(x, y - h, 60, h, rgb)
            y -= h

    canvas.line((x0, y0), (x0, y1), AXIS_RGB, 2)
    canvas.line((x0, y1), (width - 20, y1), AXIS_RGB, 2)
    for tick in range(0, int(top / MIB) + 1, max(1, int(top / MIB) // 5 // 50 * 50 or 50)):
        y = y1 - round(tick * MIB * scale)
        canvas.text(4, y - 5, f"{tick}", TEXT_RGB, s)
    title = "memory per rank by stage, mib: predicted (left) and measured (right)"
    canvas.text((width - _text_width(title, s)) // 2, 8, title, TEXT_RGB, s)
    for i, row in enumerate(rows):
        x = x0 + 40 + i * 220
        states = row["states_predicted"]
        bar(x, [(states, STATES_RGB), (row["predicted"] - states, ACTIVATIONS_RGB)])
        counted = row["states_counted"]
        bar(x + 70, [(counted, STATES_RGB), (row["measured"] - counted, MEASURED_RGB)])
        canvas.text(x + 20, y1 + 10, f"stage {row['stage']}", TEXT_RGB, s)
    legend = [("model states", STATES_RGB), ("activations, buffers: predicted", ACTIVATIONS_RGB),
              ("measured", MEASURED_RGB)]  # fmt: skip
    x = x0 + 20
    for text, rgb in legend:
        canvas.rect(x, height - 24, 12, 12, rgb)
        canvas.text(x + 18, height - 22, text, TEXT_RGB, s)
        x += 40 + _text_width(text, s)
    path.write_bytes(png_bytes(canvas.rows, width, height))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/zero-r-memory"))
    parser.add_argument("--batch", type=int, default=32, help="sequences of 128 per rank")
    args = parser.parse_args()
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
    command = f"MALLOC_MMAP_THRESHOLD_={threshold} python {' '.join(sys.argv)}"
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
