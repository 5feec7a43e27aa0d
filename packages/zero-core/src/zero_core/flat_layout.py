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
"""

from __future__ import annotations

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
    shards whose size is a multiple of ``alignment`` elements."""

    numels: tuple[int, ...]
    world_size: int
    alignment: int = 1
    param_alignment: int = 1

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

    @classmethod
    def of(
        cls, numels: Sequence[int], world_size: int, alignment: int = 1, param_alignment: int = 1
    ) -> FlatLayout:
        return cls(tuple(numels), world_size, alignment, param_alignment)

    # Cached: the engine asks for these per bucket and per tile at every step (a frozen
    # dataclass keeps them valid; cached_property writes the instance dict directly).
    @cached_property
    def numel(self) -> int:
        """Elements up to the end of the last parameter (with the gaps, without tail padding)."""
        ranges = self.param_flat_ranges()
        return ranges[-1].stop if ranges else 0

    @cached_property
    def shard_numel(self) -> int:
        """Elements of each rank's shard (a multiple of ``alignment``)."""
        return round_up(-(-self.numel // self.world_size), self.alignment)

    @property
    def padded_numel(self) -> int:
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
        return Range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

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
