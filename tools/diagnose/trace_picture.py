#!/usr/bin/env python
"""Draw torch.profiler Chrome traces as a timeline picture, one lane per rank and thread,
nested ranges stacked below their parents, as a trace viewer shows them.

    python -m tools.diagnose.trace_picture trace/ours-3.json trace/ours-3.rank1.json \\
        --labels "rank 0" "rank 1" --within ours-3 --output docs/step-trace.png

For a machine without a browser: the trace itself opens in https://ui.perfetto.dev (drag
the .json in) or chrome://tracing (Load). Each trace is one process's (a rank's) Chrome
trace, written by ``torch.profiler.profile(...).export_chrome_trace`` (tools/profile_step.py
``--trace DIR`` writes one per rank); ranks of one machine share its clock, so their
timelines line up. Drawn are the user ranges whose names start with one of ``--prefixes``
(the engine's ``zero::`` ranges and profile_step's ``phase: ...``, by default): torch's
own operators would hide them at this scale. Needs matplotlib (``pip install matplotlib``;
no package of ours depends on it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

FONT = 6.5  # points, of the labels in the bars


class Bar(NamedTuple):
    """One range on one lane: ``depth`` 0 is outermost; times in milliseconds."""

    name: str
    start: float
    end: float
    depth: int


def read_ranges(
    path: Path, prefixes: tuple[str, ...], within: str | None = None
) -> dict[int, list[tuple[str, float, float]]]:
    """Per thread id, the complete events (``"ph": "X"``) named with one of ``prefixes``:
    (name, start, end) in microseconds of the trace's clock; with ``within``, only those
    that start inside the first range of that name (e.g. profile_step's variant range).
    A trace ending in ``.gz`` is read gzipped."""
    text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    events = [e for e in json.loads(text)["traceEvents"] if e.get("ph") == "X"]
    window = (float("-inf"), float("inf"))
    if within is not None:
        outer = next((e for e in events if e.get("name") == within), None)
        if outer is None:
            raise ValueError(f"{path}: no range named {within!r} (--within)")
        window = (float(outer["ts"]), float(outer["ts"]) + float(outer.get("dur", 0.0)))
    lanes: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
    for e in events:
        name, start = e.get("name", ""), float(e["ts"])
        if name.startswith(prefixes) and window[0] <= start <= window[1]:
            lanes[int(e["tid"])].append((name, start, start + float(e.get("dur", 0.0))))
    return lanes


def stacked(ranges: list[tuple[str, float, float]], origin: float) -> list[Bar]:
    """The ranges of one thread with their nesting depth (a range inside another is one
    level below it), times in milliseconds from ``origin`` (microseconds)."""
    bars: list[Bar] = []
    open_ends: list[float] = []  # ends of the ranges enclosing the current one
    for name, start, end in sorted(ranges, key=lambda r: (r[1], -r[2])):
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        bars.append(Bar(name, (start - origin) / 1e3, (end - origin) / 1e3, len(open_ends)))
        open_ends.append(end)
    return bars


def short(name: str) -> str:
    return name.removeprefix("zero::").removeprefix("phase: ")


def draw(lanes: list[tuple[str, list[Bar]]], output: Path, title: str, width: float,
         dpi: int) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    names = sorted({b.name for _, bars in lanes for b in bars if not b.name.startswith("phase")})
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    colour: dict[str, Any] = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    rows = sum(1 + max(b.depth for b in bars) for _, bars in lanes)
    row_height = 0.32
    fig, ax = plt.subplots(figsize=(width, 1.6 + rows * row_height + 0.25 * len(lanes)))
    y, ticks, tick_labels = 0.0, [], []
    end = max(b.end for _, bars in lanes for b in bars)
    # Milliseconds one character of a label takes (about 0.55 em wide, the axes about
    # ``width`` less 1.5 inches of lane labels).
    char_ms = 0.55 * FONT / 72 * end / (width - 1.5)
    for label, bars in lanes:
        depth = 1 + max(b.depth for b in bars)
        ticks.append(y + depth / 2)
        tick_labels.append(label)
        for bar in bars:
            phase = bar.name.startswith("phase")
            face = (0.88, 0.88, 0.88) if phase else colour[bar.name]
            row = y + bar.depth
            ax.barh(row + 0.5, bar.end - bar.start, left=bar.start, height=0.9, color=face,
                    edgecolor=(0.3, 0.3, 0.3), linewidth=0.3)  # fmt: skip
            text = short(bar.name)
            if bar.end - bar.start > (len(text) + 1) * char_ms:  # the name fits in the bar
                ax.text((bar.start + bar.end) / 2, row + 0.5, text, ha="center",
                        va="center", fontsize=FONT, clip_on=True)  # fmt: skip
        y += depth + 0.6
        ax.axhline(y - 0.3, color=(0.6, 0.6, 0.6), linewidth=0.5)
    ax.set_yticks(ticks, tick_labels, fontsize=8)
    ax.set_ylim(y - 0.3, 0)  # first lane on top, children below their parents
    ax.set_xlim(0, end * 1.005)
    ax.set_xlabel("milliseconds from the first range", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=colour[n], label=short(n)) for n in names]
    ax.legend(handles=handles, fontsize=6.5, ncol=min(len(handles), 7), loc="upper center",
              bbox_to_anchor=(0.5, -0.45 / (1 + rows / 8)), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(output, dpi=dpi)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces, one per rank")
    p.add_argument("--labels", nargs="*", help="one per trace (default: the file names)")
    p.add_argument("--prefixes", nargs="*", default=["zero::", "phase: "])
    p.add_argument("--within", help="only ranges inside the range of this name (each trace's)")
    p.add_argument("--output", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--width", type=float, default=13.0, help="inches")
    p.add_argument("--dpi", type=int, default=110)
    args = p.parse_args()
    labels = args.labels or [t.stem for t in args.traces]
    if len(labels) != len(args.traces):
        p.error(f"{len(labels)} labels for {len(args.traces)} traces: give one per trace")
    per_trace = [read_ranges(t, tuple(args.prefixes), args.within) for t in args.traces]
    starts = [r[1] for lanes in per_trace for ranges in lanes.values() for r in ranges]
    if not starts:
        p.error(f"no range named {' or '.join(args.prefixes)}... in {args.traces}")
    origin = min(starts)
    lanes = []
    for label, threads in zip(labels, per_trace, strict=True):
        for number, (_, ranges) in enumerate(sorted(threads.items())):
            name = label if len(threads) == 1 else f"{label}, thread {number}"
            lanes.append((name, stacked(ranges, origin)))
    draw(lanes, args.output, args.title, args.width, args.dpi)
    print(f"{args.output}: {len(lanes)} lanes, {args.output.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
