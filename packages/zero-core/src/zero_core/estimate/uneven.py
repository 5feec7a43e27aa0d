"""zero-estimate's figures per rank with memory-weighted shards (``--shard-weights``,
ZeroConfig.shard_weights; issue 52).

Rank r of weights w holds the share f_r = w_r / sum(w) of every sharded state: the paper's
Ψ / N terms become Ψ f_r, which is the even formula at an effective world size
N_r = 1 / f_r. So each rank's row is the even row computed at N_r (a real number):

    stage 3, Adam, fp16, K = 12, weights 2, 1:   rank 0: 16 Ψ 2/3    rank 1: 16 Ψ 1/3

The engine rounds each bucket's shares to whole 128-element rows (one at least per rank),
so a measured rank differs from this by under 128 elements per bucket. The collectives
move N equal chunks of the largest share (zero_core.uneven_shards), so the link bytes and
the gradient buckets in flight follow the largest weight: N max(f) instead of 1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

PER_RANK_KEYS = ("parameters", "gradients", "optimizer_states", "device", "host", "disk")


def parse_weights(text: str) -> tuple[float, ...]:
    """``--shard-weights 2,1``: one positive number per rank."""
    try:
        weights = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not numbers like 2,1") from None
    if not all(w > 0 for w in weights):
        raise argparse.ArgumentTypeError(f"{text!r}: every weight must be positive")
    return weights


def per_rank_rows(
    args: argparse.Namespace,
    stage: int,
    row: Callable[[argparse.Namespace, int], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each rank's model-state bytes at ``stage``: ``row`` (the even row of
    zero-estimate) at the rank's effective world size."""
    weights: tuple[float, ...] = args.shard_weights
    total = sum(weights)
    rows = []
    for rank, weight in enumerate(weights):
        effective = argparse.Namespace(**{**vars(args), "world_size": total / weight})
        computed = row(effective, stage) if stage >= 1 else row(args, stage)
        rows.append(
            {"rank": rank, "weight": weight, **{key: computed[key] for key in PER_RANK_KEYS}}
        )
    return rows


def print_per_rank(rows: dict[int, dict[str, Any]]) -> None:
    """The per-rank lines under zero-estimate's table."""
    print("per rank with --shard-weights (model states; stage 0 shards nothing):")
    for stage, row in rows.items():
        for entry in row.get("ranks", []):
            host = "n/a" if entry["host"] is None else f"{entry['host'] / 1e9:.3f} GB"
            disk = "n/a" if entry["disk"] is None else f"{entry['disk'] / 1e9:.3f} GB"
            print(
                f"  stage {stage} rank {entry['rank']} (weight {entry['weight']:g}): device "
                f"{entry['device'] / 1e9:.3f} GB, host {host}, disk {disk}"
            )
