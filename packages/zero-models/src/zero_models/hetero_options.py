"""zero-train's options for mixed hardware (issue 52, docs/mixed-hardware.md):

    --micro-batches-per-rank 2,1 | auto    rank i runs c_i micro-batch slots per micro-step
    --shard-weights 2,1 | auto             rank i holds a share w_i / sum(w) of each shard
    --virtual-ranks V                      with 'auto': the slots of all ranks together
    --emulate-micro-batch-seconds 0.2,0.4  benchmarks: pad each slot to that many seconds

With counts c, the run is the homogeneous run at V = sum(c) data-parallel ranks bit for
bit: --batch-size is split over the V virtual ranks (B / V sequences per slot), and the
loss printed is the V slots' losses folded in virtual-rank order. In a --config JSON file
the keys take lists or text: {"micro_batches_per_rank": [2, 1], "shard_weights": "auto"}.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import zero_core

AUTO: Literal["auto"] = "auto"
# --config keys that take a JSON list (joined with commas into the flag's text).
LIST_OPTIONS = frozenset(
    {"micro_batches_per_rank", "shard_weights", "emulate_micro_batch_seconds"}
)  # fmt: skip
# 'auto' without --virtual-ranks: at most this many slots per rank in all (the largest
# divisor of --batch-size up to it), enough to move work between ranks in steps of 1/4.
AUTO_SLOTS_PER_RANK = 4

Counts = tuple[int, ...] | Literal["auto"] | None
Weights = tuple[float, ...] | Literal["auto"] | None


def _items(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: give comma-separated numbers, e.g. 2,1")
    return items


def counts_option(text: str) -> tuple[int, ...] | Literal["auto"]:
    """'2,1' -> (2, 1); 'auto' -> 'auto'. Each count a whole number >= 1."""
    if text.strip().lower() == AUTO:
        return AUTO
    flag = "--micro-batches-per-rank"
    try:
        counts = tuple(int(item) for item in _items(text, flag))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} {text!r}: give whole numbers of micro-batches per rank, e.g. 2,1, or auto"
        ) from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{flag} {text!r}: every rank runs at least one micro-batch; give counts >= 1"
        )
    return counts


def weights_option(text: str) -> tuple[float, ...] | Literal["auto"]:
    """'2,1' -> (2.0, 1.0); 'auto' -> 'auto'. Each weight > 0."""
    if text.strip().lower() == AUTO:
        return AUTO
    return _positive_floats(text, "--shard-weights", "shard weights, e.g. 2,1, or auto")


def seconds_option(text: str) -> tuple[float, ...]:
    """'0.2,0.4' -> (0.2, 0.4): each rank's padded seconds per micro-batch slot."""
    return _positive_floats(text, "--emulate-micro-batch-seconds", "seconds, e.g. 0.2,0.4")


def _positive_floats(text: str, flag: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(item) for item in _items(text, flag))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: give {what}") from None
    if not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: every value must be > 0; give {what}")
    return values


def add_hetero_options(p: argparse.ArgumentParser) -> None:
    """The options of this module's docstring, on zero-train's parser."""
    p.add_argument(
        "--micro-batches-per-rank", type=counts_option, metavar="C0,C1,...|auto",
        help="mixed hardware: data-parallel rank i runs C_i micro-batches per micro-step "
        "(one backward each), so the run equals the homogeneous run at sum(C) ranks bit for "
        "bit, losses included; auto: measure each rank and choose (docs/mixed-hardware.md); "
        "at --stage 3 uneven counts keep every parameter gathered from each micro-step's "
        "first forward to the rank's last backward (+ the full parameters, and a rank with "
        "several slots holds one gradient copy: the default GPT, fp32, 12.9 MiB a rank at "
        "the peak against 6.5 MiB with equal counts)",
    )  # fmt: skip
    p.add_argument(
        "--shard-weights", type=weights_option, metavar="W0,W1,...|auto",
        help="mixed memory: rank i holds a share W_i/sum(W) of each sharded buffer (stages "
        "1-3); auto: in proportion to each rank's free memory",
    )  # fmt: skip
    p.add_argument(
        "--virtual-ranks", type=int, metavar="V",
        help="with --micro-batches-per-rank auto: the micro-batches of all ranks together "
        f"(default: the largest divisor of --batch-size up to {AUTO_SLOTS_PER_RANK} per rank)",
    )  # fmt: skip
    p.add_argument(
        "--emulate-micro-batch-seconds", type=seconds_option, metavar="S0,S1,...",
        help="for benchmarks: pad each micro-batch's forward and backward on rank i with a "
        "sleep to S_i seconds, emulating slower hardware without changing a bit",
    )  # fmt: skip


def resolve_virtual_ranks(args: argparse.Namespace, data_parallel: int) -> int:
    """Check the mixed-hardware options against ``data_parallel`` ranks and --batch-size,
    and return V, the virtual ranks --batch-size is split over (``data_parallel`` without
    --micro-batches-per-rank). Sets ``args.virtual_total``. Raises ValueError naming the
    fix."""
    counts: Counts = args.micro_batches_per_rank
    for flag, given in (
        ("--micro-batches-per-rank", counts),
        ("--shard-weights", args.shard_weights),
        ("--emulate-micro-batch-seconds", args.emulate_micro_batch_seconds),
    ):
        if isinstance(given, tuple) and len(given) != data_parallel:
            raise ValueError(
                f"{flag} {','.join(f'{v:g}' for v in given)}: {len(given)} values for "
                f"{data_parallel} data-parallel ranks; give one per rank"
            )
    if (counts is not None or args.shard_weights is not None) and args.tp > 1:
        raise ValueError(
            "--micro-batches-per-rank/--shard-weights with --tp > 1: mixed hardware is for "
            "data parallelism alone; drop one of them"
        )
    if args.virtual_ranks is not None and counts != AUTO:
        raise ValueError(
            "--virtual-ranks is for --micro-batches-per-rank auto (given counts set "
            "V = their sum); drop it or use auto"
        )
    if counts == AUTO:
        total = args.virtual_ranks or auto_virtual_ranks(args.batch_size, data_parallel)
        if total < data_parallel:
            raise ValueError(
                f"--virtual-ranks {total}: each of the {data_parallel} data-parallel ranks "
                f"needs a micro-batch; give at least {data_parallel}"
            )
    elif counts is not None:
        total = sum(counts)
    else:
        total = data_parallel
    # A --deepspeed config sets the batch itself (its micro-batch times V) unless the
    # command line gives one.
    deepspeed_batch = args.deepspeed is not None and "batch_size" not in getattr(args, "given", ())
    if args.batch_size % total and not deepspeed_batch:
        where = "data-parallel ranks" if counts is None else "virtual ranks (micro-batches)"
        raise ValueError(
            f"--batch-size {args.batch_size} does not split over {total} {where}; use a "
            f"multiple of {total} (e.g. --batch-size {-(-args.batch_size // total) * total})"
            + (" or another --nproc" if counts is None else " or other counts")
        )
    args.virtual_total = total
    return total


def auto_virtual_ranks(batch_size: int, data_parallel: int) -> int:
    """'auto's V without --virtual-ranks: the largest divisor of ``batch_size`` from
    ``data_parallel`` up to AUTO_SLOTS_PER_RANK per rank (``data_parallel`` if none)."""
    top = min(batch_size, AUTO_SLOTS_PER_RANK * data_parallel)
    divisors = (v for v in range(top, data_parallel - 1, -1) if batch_size % v == 0)
    return next(divisors, data_parallel)


def hetero_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ZeroConfig fields of --micro-batches-per-rank and --shard-weights (only those
    given: a homogeneous run's config is today's). Raises ValueError if this zero_core's
    ZeroConfig lacks the field: an option is never dropped without a word."""
    settings: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(zero_core.ZeroConfig)}
    for name, flag in (
        ("micro_batches_per_rank", "--micro-batches-per-rank"),
        ("shard_weights", "--shard-weights"),
    ):
        value = getattr(args, name, None)
        if value is None:
            continue
        if name not in fields:
            raise ValueError(
                f"{flag}: this zero_core's ZeroConfig has no {name!r} field, so the engine "
                f"cannot honour it; update zero-core, or drop {flag}"
            )
        settings[name] = value
    return settings


def with_hetero(args: argparse.Namespace, zero: zero_core.ZeroConfig) -> zero_core.ZeroConfig:
    """``zero`` (a --deepspeed config's, which has no such keys) with the mixed-hardware
    options applied. Raises ValueError naming the flag."""
    settings = hetero_settings(args)
    if not settings:
        return zero
    try:
        return dataclasses.replace(zero, **settings)
    except ValueError as exc:
        raise ValueError(f"--micro-batches-per-rank/--shard-weights: {exc}") from None


def list_flag(key: str, value: Sequence[object]) -> str:
    """A --config JSON list for one of LIST_OPTIONS as the flag's text: [2, 1] -> '2,1'.
    Raises ValueError for anything but numbers."""
    if not value or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{key}={list(value)!r} must be a list of numbers, one per rank")
    return ",".join(str(v) for v in value)
