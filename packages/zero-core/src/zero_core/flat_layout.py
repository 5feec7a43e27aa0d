"""Where each parameter lives in a padded flat buffer, and which part each rank owns.

Pure arithmetic: no tensors are moved and nothing is communicated here.

Four index spaces, each with its own name (as in Megatron's distributed optimizer):

    flat_range    elements of the whole padded buffer of a group
    local_range   elements of this rank's shard, 0 .. shard_numel
    param_range   elements of one parameter, 0 .. param.numel()
    bucket_range  elements of one communication bucket (a sub-range of the flat buffer)

Example: parameters of 5, 7 and 2 elements on N = 4 ranks, alignment 2. 14 elements pad
to 16 = 4 shards of 4:

    flat      0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
    params    a a a a | a b b b | b b  b  b | c  c  .  .     (. = padding)
    rank          0   |    1    |     2     |     3

Rank 1 owns flat [4, 8): a's param_range [4, 5) at local [0, 1) and b's param_range
[0, 3) at local [1, 4). A parameter may straddle shards; the tail padding is below
N x alignment.

With ``param_alignment`` > 1 every parameter also starts at a multiple of it (zeros fill
the gaps), so fixed-size blocks of a parameter never straddle a shard boundary when the
shard size is a multiple of the block: the gradient norm uses that (see grad_norm).

With ``weights`` (issue 52, zero_core.uneven_shards) the shards are uneven: rank r owns
``shard_sizes[r]`` elements, proportional to its weight, each a multiple of ``alignment``;
the buffer is still the parameters end to end, and only the boundaries move. The same
14 elements on N = 2 ranks with weights (3, 1), alignment 2 (7 alignment units: one per
rank first, the other 5 split 3:1 by rounding, so 5 and 2):

    flat      0 1 2 3 4 5 6 7 8 9 | 10 11 12 13
    params    a a a a a b b b b b |  b  b  c  c
    rank               0          |      1

``shard_numel`` is then the largest share: the chunk each rank puts on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


@dataclass(frozen=True)
class Range:
    """The half-open interval [start, stop) of element indices; empty when stop <= start."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.stop < self.start:
            raise ValueError(f"Range({self.start}, {self.stop}) must have 0 <= start <= stop")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def intersect(self, other: Range) -> Range:
        """The overlap of two ranges; ``Range(s, s)`` (empty) when they do not overlap."""
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Range(start, max(start, stop))

    def shift(self, offset: int) -> Range:
        """The same range in a space whose origin is ``offset`` elements further left."""
        return Range(self.start - offset, self.stop - offset)


class ShardPiece(NamedTuple):
    """The part of one parameter that lies in one rank's shard, in three index spaces."""

    param_index: int  # which parameter of the group
    param_range: Range  # inside the parameter
    local_range: Range  # inside the rank's shard
    flat_range: Range  # inside the padded flat buffer


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Parameters of ``numels`` elements laid end to end, padded into ``world_size`` equal
    shards whose size is a multiple of ``alignment`` elements (with ``weights``: one share
    per rank proportional to its weight, each a multiple of ``alignment``)."""

    numels: tuple[int, ...]
    world_size: int
    alignment: int = 1
    param_alignment: int = 1
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if self.alignment < 1 or self.param_alignment < 1:
            raise ValueError(
                f"alignment and param_alignment must be at least 1, got {self.alignment} "
                f"and {self.param_alignment}"
            )
        if any(n < 0 for n in self.numels):
            raise ValueError(f"parameter sizes must be >= 0, got {self.numels}")
        if self.weights is not None and len(self.weights) != self.world_size:
            raise ValueError(
                f"weights {self.weights} must have one entry per rank ({self.world_size})"
            )

    @classmethod
    def of(
        cls,
        numels: Sequence[int],
        world_size: int,
        alignment: int = 1,
        param_alignment: int = 1,
        weights: Sequence[float] | None = None,
    ) -> FlatLayout:
        return cls(
            tuple(numels),
            world_size,
            alignment,
            param_alignment,
            None if weights is None else tuple(weights),
        )

    @property
    def uneven(self) -> bool:
        """Whether the shards follow weights (their sizes may differ)."""
        return self.weights is not None

    # Cached: the engine asks for these per bucket and per tile at every step (a frozen
    # dataclass keeps them valid; cached_property writes the instance dict directly).
    @cached_property
    def numel(self) -> int:
        """Elements up to the end of the last parameter (with the gaps, without tail padding)."""
        ranges = self.param_flat_ranges()
        return ranges[-1].stop if ranges else 0

    @cached_property
    def shard_numel(self) -> int:
        """Elements of each rank's shard (a multiple of ``alignment``); with weights, the
        largest share (the equal chunk every rank sends in a collective)."""
        if self.weights is not None:
            return max(self.shard_sizes)
        return round_up(-(-self.numel // self.world_size), self.alignment)

    @cached_property
    def shard_sizes(self) -> tuple[int, ...]:
        """Elements of each rank's shard, in rank order (all ``shard_numel`` when even)."""
        if self.weights is None:
            return (self.shard_numel,) * self.world_size
        units = max(-(-self.numel // self.alignment), self.world_size)
        return tuple(u * self.alignment for u in weighted_units(units, self.weights))

    @cached_property
    def shard_starts(self) -> tuple[int, ...]:
        """Where each rank's shard starts in the flat buffer."""
        starts, at = [], 0
        for size in self.shard_sizes:
            starts.append(at)
            at += size
        return tuple(starts)

    @property
    def padded_numel(self) -> int:
        """Elements of the whole buffer, every shard's padding included."""
        return sum(self.shard_sizes)

    @property
    def wire_numel(self) -> int:
        """Elements a collective of the whole buffer moves: N chunks of ``shard_numel``
        (``padded_numel`` when even)."""
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def param_flat_ranges(self) -> list[Range]:
        """Each parameter's place in the flat buffer (flat_range)."""
        ranges, stop = [], 0
        for n in self.numels:
            start = round_up(stop, self.param_alignment)
            ranges.append(Range(start, start + n))
            stop = start + n
        return ranges

    def shard_flat_range(self, rank: int) -> Range:
        """The flat_range rank ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        start = self.shard_starts[rank]
        return Range(start, start + self.shard_sizes[rank])

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The non-empty parts of parameters inside rank ``rank``'s shard, in flat order."""
        shard = self.shard_flat_range(rank)
        pieces = []
        for index, flat in enumerate(self.param_flat_ranges()):
            overlap = flat.intersect(shard)
            if overlap.size > 0:
                pieces.append(
                    ShardPiece(
                        index, overlap.shift(flat.start), overlap.shift(shard.start), overlap
                    )
                )
        return pieces


def weighted_units(units: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``units`` (>= len(weights)) split over ranks in proportion to ``weights``: one each
    first (no rank owns nothing), the rest by rounding the cumulative share, so the
    parts add up to ``units`` exactly and depend only on (units, weights)."""
    n = len(weights)
    if units < n:
        raise ValueError(f"{units} units cannot give each of {n} ranks one")
    total, spare = float(sum(weights)), units - n
    bounds, cumulative = [0], 0.0
    for w in weights:
        cumulative += w
        bounds.append(min(spare, math.floor(spare * cumulative / total + 0.5)))
    bounds[-1] = spare
    return tuple(1 + bounds[r + 1] - bounds[r] for r in range(n))
