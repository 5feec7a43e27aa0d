"""zero-train's learning rate: linear warm-up to --lr, then cosine decay to a tenth of it,
unless a --deepspeed config brings its own optimizer or scheduler."""

from __future__ import annotations

import argparse
import math


def own_schedule(args: argparse.Namespace) -> bool:
    """Whether zero-train sets the learning rate itself (not when --deepspeed brings an
    optimizer or a scheduler: then the config's own rate and schedule rule)."""
    setup = getattr(args, "deepspeed_setup", None)
    return setup is None or (setup.optimizer is None and setup.scheduler is None)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to a tenth of it."""
    if step < args.warmup:
        return float(args.lr * (step + 1) / args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return float(args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))))
