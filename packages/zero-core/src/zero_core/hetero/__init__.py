"""Mixed hardware (issue 52): profile-based choices of micro-batches per rank and shard
weights, and the step time they predict (choice.py, pure functions).

    counts = choose_micro_batches([0.2, 0.4], total=12)       # (8, 4)
    weights = choose_shard_weights([32e9, 16e9])              # (0.667, 0.333)
    predicted_step_seconds(counts, [0.2, 0.4], accumulation=1)  # 1.6

planned.py adds what a step costs once (the row reduction, the optimizer, the gathers
after the step) from the planner's terms (zero_core.plan) on a calibrated cluster.
"""

from .choice import (
    choose_micro_batches,
    choose_shard_weights,
    even_counts,
    ideal_micro_step_seconds,
    micro_step_seconds,
    predicted_step_seconds,
)

__all__ = [
    "choose_micro_batches",
    "choose_shard_weights",
    "even_counts",
    "ideal_micro_step_seconds",
    "micro_step_seconds",
    "predicted_step_seconds",
]
