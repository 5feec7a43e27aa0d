"""The buckets of one parameter group, and what each rank owns of each bucket.

Parameters are packed in order into buckets of about ``bucket_numel`` elements (a parameter
never splits across buckets; one larger than ``bucket_numel`` gets a bucket of its own).
Every parameter starts at a multiple of BLOCK (see grad_norm), and each bucket is a
:class:`FlatLayout` padded to N equal shards. Rank r owns the r-th shard of every bucket;
its *local shard* is those pieces one after another:

    bucket 0 (padded P0)          bucket 1 (padded P1)
    | r0 | r1 | r2 | r3 |         | r0 | r1 | r2 | r3 |
    rank 1's local shard = [ bucket 0 slice | bucket 1 slice ]   (P0/N + P1/N elements)

Bucket boundaries depend on the parameters and ``bucket_numel`` only, never on N, and a
reduce-scatter of one bucket hands every rank exactly its slice of that bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .flat_layout import FlatLayout, Range, round_up
from .grad_norm import BLOCK


@dataclass(frozen=True)
class Bucket:
    """One bucket: which parameters (group indices), their layout, and where this bucket's
    slice starts in every rank's local shard."""

    param_indices: tuple[int, ...]
    layout: FlatLayout
    local_offset: int

    @property
    def slice_numel(self) -> int:
        return self.layout.shard_numel


@dataclass(frozen=True)
class GroupLayout:
    numels: tuple[int, ...]
    world_size: int
    buckets: tuple[Bucket, ...]

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int, bucket_numel: int) -> GroupLayout:
        groups: list[list[int]] = []
        filled = 0
        for index, numel in enumerate(numels):
            start = round_up(filled, BLOCK)
            if groups and groups[-1] and start + numel > bucket_numel:
                groups.append([])
                start = 0
            if not groups:
                groups.append([])
            groups[-1].append(index)
            filled = start + numel
        buckets, offset = [], 0
        for members in groups:
            layout = FlatLayout.of(
                [numels[i] for i in members], world_size, alignment=BLOCK, param_alignment=BLOCK
            )
            buckets.append(Bucket(tuple(members), layout, offset))
            offset += layout.shard_numel
        return cls(tuple(numels), world_size, tuple(buckets))

    @property
    def shard_numel(self) -> int:
        """Elements of a rank's local shard (the same on every rank)."""
        return sum(b.slice_numel for b in self.buckets)

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
