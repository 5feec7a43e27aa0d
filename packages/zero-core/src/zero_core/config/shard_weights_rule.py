"""The rule of ``ZeroConfig.shard_weights`` (issue 52): how the weights are written, and
which settings they cannot be combined with, and why (zero_core.uneven_shards explains
the uneven layout itself).

    ZeroConfig(stage=3, shard_weights=[2, 1])   rank 0 holds 2/3 of every sharded state

A list is normalised to a tuple of floats; its length is checked against the world size
when the engine is built (the config does not know it).
"""

from __future__ import annotations

import math
from typing import Any

# The settings whose collectives assume N equal chunks of the shard group's ranks.
_REFUSED = (
    ("shard_group_size", "hybrid sharding lays states out over a shard group"),
    ("hpz_partition_size", "hpZ keeps an equal secondary partition per node"),
    ("hierarchical_gather", "the hierarchical gather moves equal node chunks"),
    ("quantize_weights", "qwZ quantizes equal chunks"),
    ("quantize_gradients", "qgZ's all-to-all reduces equal chunks"),
)


def normalise_shard_weights(value: Any) -> tuple[float, ...] | str | None:
    """``shard_weights`` as the config keeps it: None, "auto", or a tuple of positive,
    finite floats (a list or tuple given by the user)."""
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str):
        try:  # "2,1" as a command line gives it
            value = [float(v) for v in value.split(",")]
        except ValueError:
            raise ValueError(
                f"shard_weights={value!r}: give one number per data-parallel rank, "
                "like [2, 1] or '2,1', or 'auto', or None for even shards"
            ) from None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"shard_weights={value!r}: give one number per data-parallel rank, like [2, 1], "
            "or 'auto', or None for even shards"
        )
    bad = [
        v
        for v in value
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0
    ]
    if bad:
        raise ValueError(
            f"shard_weights={list(value)!r}: every entry must be a positive finite number "
            f"(got {bad}); a rank's share of the sharded states is its weight / their sum"
        )
    return tuple(float(v) for v in value)


def shard_weights_error(config: Any) -> str:
    """Why ``config`` (a ZeroConfig, checking itself) cannot use its ``shard_weights``
    ("" if it can, or sets none)."""
    if config.shard_weights is None:
        return ""
    conflicts = [f"{name} ({why})" for name, why in _REFUSED if _is_on(getattr(config, name))]
    if conflicts:
        return (
            f"shard_weights={config.shard_weights!r} cannot be combined with "
            f"{', '.join(conflicts)}: uneven shards need every rank to be its own shard "
            "owner over plain collectives; turn those off, or leave shard_weights None"
        )
    return ""


def _is_on(value: Any) -> bool:
    """Whether a refused setting is on: set at all, or True, or a size above 1."""
    if value is None or value is False:
        return False
    return value is True or isinstance(value, str) or value > 1


def check_world(weights: tuple[float, ...] | str | None, world_size: int) -> None:
    """The engine's check once the data-parallel world is known."""
    if weights == "auto":
        raise ValueError(
            "shard_weights='auto' must be resolved into one weight per rank before the "
            "engine is built (zero-train does it from each rank's free memory); pass the "
            "list, like [2, 1]"
        )
    if isinstance(weights, tuple) and len(weights) != world_size:
        raise ValueError(
            f"shard_weights={list(weights)} has {len(weights)} entries for {world_size} "
            f"data-parallel ranks: give exactly {world_size} (one per rank, in rank order)"
        )
