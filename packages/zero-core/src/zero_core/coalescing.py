"""Which collectives share one launch: consecutive items, up to a number of elements.

A collective has a fixed cost whatever its size, so the engine launches runs of small
buckets (gradient reductions, grad_reducer) and of small units (stage 3's prefetched
gathers, param_gatherer) as one collective each. The rule is one for both, and it depends
only on sizes, kinds (how each is launched) and order, so every rank cuts the same groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def coalesced_groups(
    order: Sequence[int],
    numels: Sequence[int],
    alone: Sequence[bool],
    coalesce_numel: int,
    kinds: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Items in launch ``order`` cut into groups launched together: runs of consecutive
    items whose ``numels`` add up to at most ``coalesce_numel`` (and, given ``kinds``, of
    one kind); an item marked ``alone`` (or larger than the limit) is a group of its own.
    Groups keep ``order``."""
    groups: list[list[int]] = []
    filled = 0
    for index in order:
        numel = numels[index]
        if (
            groups
            and not alone[index]
            and not alone[groups[-1][0]]
            and filled + numel <= coalesce_numel
            and (kinds is None or kinds[index] == kinds[groups[-1][0]])
        ):
            groups[-1].append(index)
            filled += numel
        else:
            groups.append([index])
            filled = numel
    return groups
