"""The rule of ``ZeroConfig.micro_batches_per_rank`` (issue 52): how the counts are
written (zero_core.virtual_ranks explains what each physical rank then runs).

    ZeroConfig(micro_batches_per_rank=[2, 1])   rank 0 runs 2 micro-batch slots per
                                                micro-step, rank 1 runs 1 (V = 3)

A list is normalised to a tuple of ints; its length is checked against the world size
when the engine is built (the config does not know it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

CountsSetting = tuple[int, ...] | Literal["auto"] | None


def normalise_counts(name: str, value: object) -> CountsSetting:
    """A config's ``micro_batches_per_rank`` (or a like list) as a tuple, "auto" or None.

    Raises ValueError naming the fix. The length is checked against the world later
    (:meth:`VirtualRanks.for_world`), when the world is known."""
    if value is None or value == "auto":
        return value  # exactly None or "auto"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(
            f"{name}={value!r}: give one int >= 1 per data-parallel rank (a list or tuple, "
            "e.g. [2, 1]), 'auto', or None for one micro-batch per rank"
        )
    counts = tuple(value)
    bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if not counts or bad:
        raise ValueError(
            f"{name}={list(counts)!r}: every entry must be an int >= 1 (micro-batches that "
            f"rank runs per micro-step); {bad[0] if bad else 'an empty list'!r} is not"
        )
    return counts
