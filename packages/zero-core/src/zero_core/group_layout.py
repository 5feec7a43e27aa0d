"""The buckets of one parameter group, and what each rank owns of each bucket.

Parameters are packed in order into buckets of about ``bucket_numel`` elements (a parameter
never splits across buckets; one larger than ``bucket_numel`` gets a bucket of its own);
stage 3 also keeps each bucket within one fetch unit (``tags``).
Every parameter starts at a multiple of BLOCK (see grad_norm), and each bucket is a
:class:`FlatLayout` padded to N equal shards. Rank r owns the r-th shard of every bucket;
its *local shard* is those pieces one after another:

    bucket 0 (padded P0)          bucket 1 (padded P1)
    | r0 | r1 | r2 | r3 |         | r0 | r1 | r2 | r3 |
    rank 1's local shard = [ bucket 0 slice | bucket 1 slice ]   (P0/N + P1/N elements)

Bucket boundaries depend on the parameters and ``bucket_numel`` only, never on N, and a
reduce-scatter of one bucket hands every rank exactly its slice of that bucket.

With ``weights`` (issue 52) every bucket is split in proportion to them instead
(flat_layout), so a rank's slices, its local shard and the offsets of its slices in it
differ from rank to rank: a GroupLayout is built for one ``rank``, whose numbers
``slice_numel``, ``local_offset`` and ``shard_numel`` give; ``local_pieces(r)`` and
``row_keys(r)`` still answer for any rank r.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .flat_layout import FlatLayout, Range, round_up
from .grad_norm import BLOCK

# Elements per rank below which an oversized bucket is not cut any finer: with a tiny
# bucket_numel, pieces of a few elements would cost one collective each.
MIN_PIECE_NUMEL = 4096


def piece_numel(padded_numel: int, bucket_numel: int, world_size: int) -> int:
    """Elements per rank of each piece a bucket of ``padded_numel`` is moved in: its whole
    slice when it fits ``bucket_numel``, else ``bucket_numel / N`` (at least MIN_PIECE_NUMEL;
    see grad_reducer). A bucket is *oversized* when this is less than its slice."""
    slice_numel = padded_numel // world_size
    if padded_numel <= bucket_numel:
        return slice_numel
    return min(slice_numel, max(bucket_numel // world_size, MIN_PIECE_NUMEL))


class LocalPiece(NamedTuple):
    """The part of one parameter in one rank's local shard of a group, in four index
    spaces: which parameter (its index in the group), which bucket, the elements of the
    parameter (param_range), where they sit in the rank's local shard (local_range) and
    in the bucket (flat_range)."""

    param_index: int
    bucket: int
    param_range: Range
    local_range: Range
    flat_range: Range


@dataclass(frozen=True)
class BucketLayout:
    """One bucket's geometry: which parameters (group indices), their layout, and where
    this bucket's slice starts in each rank's local shard (``local_offsets``; the same on
    every rank unless the shards are uneven). ``slice_numel`` and ``local_offset`` are
    those of ``rank``, the rank the layout was built for (buckets.Bucket adds the slots
    and a component's state)."""

    param_indices: tuple[int, ...]
    layout: FlatLayout
    local_offsets: tuple[int, ...]
    rank: int = 0

    @property
    def local_offset(self) -> int:
        return self.local_offsets[self.rank]

    @property
    def slice_numel(self) -> int:
        return self.layout.shard_sizes[self.rank]

    def slice_of(self, rank: int) -> int:
        """Elements of rank ``rank``'s slice of this bucket."""
        return self.layout.shard_sizes[rank]


@dataclass(frozen=True)
class GroupLayout:
    numels: tuple[int, ...]
    world_size: int
    buckets: tuple[BucketLayout, ...]
    weights: tuple[float, ...] | None = None
    rank: int = 0

    @property
    def uneven(self) -> bool:
        """Whether the shards follow weights (zero_core.uneven_shards)."""
        return self.weights is not None

    @classmethod
    def build(
        cls,
        numels: Sequence[int],
        world_size: int,
        bucket_numel: int,
        tags: Sequence[object] | None = None,
        alignment: int = BLOCK,
        weights: Sequence[float] | None = None,
        rank: int = 0,
    ) -> GroupLayout:
        """Pack parameters into buckets of about ``bucket_numel`` elements. With ``tags``
        (one per parameter; stage 3 uses the fetch unit), a bucket holds parameters of
        one tag only, in parameter order; otherwise it holds consecutive parameters.
        ``alignment``: where every parameter starts and what a shard is a multiple of
        (BLOCK for the partitioned stages' gradient norm; 1 packs without gaps);
        ``weights``: uneven shards in proportion to them (None: even); ``rank``: whose
        slices ``slice_numel`` and ``local_offset`` describe."""
        members: dict[object, list[list[int]]] = {}
        filled: dict[object, int] = {}
        order: list[list[int]] = []
        for index, numel in enumerate(numels):
            tag = tags[index] if tags is not None else None
            runs = members.setdefault(tag, [])
            start = round_up(filled.get(tag, 0), alignment)
            if not runs or (runs[-1] and start + numel > bucket_numel):
                runs.append([])
                order.append(runs[-1])
                start = 0
            runs[-1].append(index)
            filled[tag] = start + numel
        return cls.of_buckets(numels, world_size, order, alignment, weights, rank)

    @classmethod
    def whole(cls, numels: Sequence[int]) -> GroupLayout:
        """One bucket holding every parameter end to end, without gaps, owned whole by
        one rank (world size 1): the layout of a replicated group (stage 0)."""
        return cls.of_buckets(numels, 1, [list(range(len(numels)))] if numels else [], 1)

    @classmethod
    def of_buckets(
        cls,
        numels: Sequence[int],
        world_size: int,
        members: Sequence[Sequence[int]],
        alignment: int = BLOCK,
        weights: Sequence[float] | None = None,
        rank: int = 0,
    ) -> GroupLayout:
        """Buckets holding exactly ``members`` (indices into ``numels``; every parameter in
        one bucket), in that order."""
        placed = sorted(i for bucket in members for i in bucket)
        if placed != list(range(len(numels))):
            raise ValueError(f"bucket members {members} must hold each of {len(numels)} once")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        buckets, offsets = [], [0] * world_size
        for bucket_members in members:
            layout = FlatLayout.of(
                [numels[i] for i in bucket_members],
                world_size,
                alignment=alignment,
                param_alignment=alignment,
                weights=weights,
            )
            buckets.append(BucketLayout(tuple(bucket_members), layout, tuple(offsets), rank))
            offsets = [o + size for o, size in zip(offsets, layout.shard_sizes, strict=True)]
        frozen = None if weights is None else tuple(float(w) for w in weights)
        return cls(tuple(numels), world_size, tuple(buckets), frozen, rank)

    @property
    def shard_numel(self) -> int:
        """Elements of ``rank``'s local shard (the same on every rank when even)."""
        return sum(b.slice_numel for b in self.buckets)

    def shard_numel_of(self, rank: int) -> int:
        """Elements of rank ``rank``'s local shard."""
        return sum(b.slice_of(rank) for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        """Elements of all buckets, padding included (what a full replica holds)."""
        return sum(b.layout.padded_numel for b in self.buckets)

    def param_places(self) -> list[tuple[int, Range]]:
        """For each parameter of the group: (bucket index, its flat_range in that bucket)."""
        places: list[tuple[int, Range]] = [(0, Range(0, 0))] * len(self.numels)
        for k, bucket in enumerate(self.buckets):
            for position, flat in zip(
                bucket.param_indices, bucket.layout.param_flat_ranges(), strict=True
            ):
                places[position] = (k, flat)
        return places

    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """The non-empty parts of parameters in rank ``rank``'s local shard, in local order:
        the one computation of "which elements of which parameter does this shard hold"
        that masters, gradients, parameter shards and checkpoints all use.

            bucket k slice of rank r:   local [off, off + S)  =  flat [r*S, (r+1)*S)
            a parameter at flat [a, b) contributes flat [a, b) & [r*S, (r+1)*S)
        """
        pieces = []
        for k, bucket in enumerate(self.buckets):
            for piece in bucket.layout.shard_pieces(rank):
                pieces.append(
                    LocalPiece(
                        bucket.param_indices[piece.param_index],
                        k,
                        piece.param_range,
                        piece.local_range.shift(-bucket.local_offsets[rank]),
                        piece.flat_range,
                    )
                )
        return pieces

    def row_keys(self, rank: int) -> list[tuple[int, int]]:
        """For each BLOCK row of rank ``rank``'s local shard: (parameter index, row within
        the parameter), or (len(numels), 0) for a row of padding. Sorting rows by these
        keys lists them in parameter order, whatever the bucketing (see grad_norm)."""
        rows = self.shard_numel_of(rank) // BLOCK
        keys = [(len(self.numels), 0)] * rows
        for piece in self.local_pieces(rank):
            first = piece.param_range.start // BLOCK
            start = piece.local_range.start // BLOCK
            for row in range(-(-piece.param_range.size // BLOCK)):
                keys[start + row] = (piece.param_index, first + row)
        return keys
