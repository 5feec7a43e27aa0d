"""The plots of a zero-train run, drawn with matplotlib (the ``plots`` extra).

    OUT/loss.png    three panels against step: loss (and the learning rate, right axis),
                    tokens per second, and resident memory of each rank

matplotlib is optional: without it :func:`write_run_plots` draws nothing and returns the
one line that says how to get it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'zero-models[plots]' (matplotlib) to get OUT/loss.png"


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_run_plots(path: Path, steps: Sequence[dict[str, Any]]) -> str | None:
    """Draw ``steps`` (metrics.jsonl step records of one or more runs, in order) to
    ``path``; None when written, else the reason it was not (matplotlib missing)."""
    if not plots_available():
        return f"no plot: {INSTALL_HINT}"
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot as plt

    x = [int(r["step"]) + 1 for r in steps]
    figure, (loss_axis, rate_axis, memory_axis) = plt.subplots(
        3, 1, figsize=(8, 9), sharex=True, constrained_layout=True
    )
    loss_axis.plot(x, [r["loss"] for r in steps], color="tab:blue", linewidth=1)
    loss_axis.set_ylabel("loss")
    loss_axis.set_title("zero-train")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(x, [r["lr"] for r in steps], color="tab:orange", linewidth=1)
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    rate_axis.plot(x, [r["tokens_per_s"] for r in steps], color="tab:green", linewidth=1)
    rate_axis.set_ylabel("tokens / s")
    # A run resumed on another number of ranks has segments of different widths: each
    # rank is drawn at the steps where it ran.
    ranks = max((len(r["rss_mib"]) for r in steps), default=0)
    for rank in range(ranks):
        ran = [i for i, r in enumerate(steps) if rank < len(r["rss_mib"])]
        memory_axis.plot([x[i] for i in ran], [steps[i]["rss_mib"][rank] for i in ran],
                         linewidth=1, label=f"rank {rank}")  # fmt: skip
    memory_axis.set_ylabel("resident MiB")
    memory_axis.set_xlabel("step")
    if ranks:
        memory_axis.legend(loc="lower right", fontsize="small")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
