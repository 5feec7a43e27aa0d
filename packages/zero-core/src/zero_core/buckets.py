"""The buckets of every optimizer group as objects: what a component keeps per bucket.

group_layout says where buckets lie (pure arithmetic); this module makes one object per
bucket that carries that geometry together with the ParamSlots it holds, so components
hold buckets and read ``bucket.slice_numel``, ``bucket.slots``, ``bucket.full_buffer``
instead of indexing parallel ``[group][bucket]`` lists:

    GroupLayout per group --build_buckets(layouts, table)--> BucketTable
    BucketTable     .groups[g]: GroupBuckets      for bucket in table: (group, bucket) order
    GroupBuckets    .layout, .buckets[k]: Bucket  overlapping(start, stop): local ranges
    Bucket          group, index (in its group), position (in the table)
                    geometry (group_layout.BucketLayout), slots (its ParamSlots)

One group, N = 2, two buckets (P: padded bucket elements, S = P / N: one rank's slice):

    flat buffers (whole, every rank)      local shard (rank 1)
    bucket 0 | r0: S0 | r1: S0 |          | bucket 0 slice | bucket 1 slice |
    bucket 1 | r0: S1 | r1: S1 |          0                S0               S0 + S1
               slots a, b in bucket 0       local_range of bucket 1 = [S0, S0 + S1)
               slot c in bucket 1           (its local_offset is S0 on every rank)

Each component keeps its own run-time state per bucket in a subclass of :class:`Bucket`
defined next to it, built from this module's geometry buckets (``Bucket.base``):

    ReplicatedBucket   replicated_params   full_buffer (compute dtype, whole), owned
                                           (this rank's slice of it), received (count)
    GradBucket         grad_reducer        target (this rank's reduced slice), full_buffer
                                           (stage 1's gradient bucket; None when sharded),
                                           the reducer's staging, held, pieces_left
    MasterBucket       master_weights      values (this rank's float32 slice), tiles
    UnitBucket         gather_unit         full_buffer (a stage-3 unit's gathered bucket)

Per-component classes, not one bucket holding every component's state: the stage policy
picks parameters, gradients and masters independently (replicated or sharded, all-reduced
or reduce-scattered, separate, aliased or offloaded), so one shared object would carry
the optional fields of every combination, and two components could write each other's
state. Megatron-Core's ``_ParamAndGradBucket`` holds both because one buffer class holds
parameters and gradients together; here the geometry and the slots are the shared part
(a base object each component's bucket copies, holding no tensor), and each component
owns its own bucket state. A bucket holds views of its component's buffers, never copies.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .flat_layout import FlatLayout, Range
from .group_layout import BucketLayout, GroupLayout
from .param_table import ParamSlot, ParamTable

# The fields every bucket has: ``Subclass(*bucket.base(), state...)`` makes a component's
# bucket from a geometry bucket.
BucketBase = tuple[int, int, int, BucketLayout, tuple[ParamSlot, ...]]


@dataclass(eq=False)
class Bucket:
    """One bucket of one optimizer group: where it lies and the parameters it holds.

    ``index``: its place in its group; ``position``: its place among every group's
    buckets in (group, bucket) order (the bucket reducer's index); ``slots``: its
    ParamSlots in group order (empty when the table was not given: the masters address
    their buckets by local range only). ``eq=False``: a bucket is equal only to itself,
    so it can key a dict."""

    group: int
    index: int
    position: int
    geometry: BucketLayout
    slots: tuple[ParamSlot, ...]

    def base(self) -> BucketBase:
        """Its fields as a geometry bucket: (group, index, position, geometry, slots)."""
        return (self.group, self.index, self.position, self.geometry, self.slots)

    @property
    def layout(self) -> FlatLayout:
        """Its parameters end to end, padded into N equal slices (flat_layout)."""
        return self.geometry.layout

    @property
    def padded_numel(self) -> int:
        """Elements of the whole bucket, padding included (N x slice_numel; with uneven
        shards the sum of every rank's slice)."""
        return self.geometry.layout.padded_numel

    @property
    def slice_numel(self) -> int:
        """Elements of this rank's slice of it (the same on every rank unless uneven)."""
        return self.geometry.slice_numel

    @property
    def local_offset(self) -> int:
        """Where its slice starts in every rank's local shard of the group."""
        return self.geometry.local_offset

    @property
    def local_range(self) -> Range:
        """Its slice's elements in the group's local shard."""
        return Range(self.local_offset, self.local_offset + self.slice_numel)

    def owned_range(self, rank: int) -> Range:
        """The flat_range (in the bucket) of rank ``rank``'s slice."""
        return self.geometry.layout.shard_flat_range(rank)


B = TypeVar("B", bound=Bucket)
C = TypeVar("C", bound=Bucket)


@dataclass(eq=False)
class GroupBuckets(Generic[B]):
    """The buckets of one optimizer group, in order; their slices tile the group's local
    shard and the buckets themselves tile its flat buffers (no gap, no overlap)."""

    group: int
    layout: GroupLayout
    buckets: tuple[B, ...]

    def __post_init__(self) -> None:
        self._offsets = [bucket.local_offset for bucket in self.buckets]

    def __iter__(self) -> Iterator[B]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, index: int) -> B:
        return self.buckets[index]

    def overlapping(self, start: int, stop: int) -> Iterator[tuple[B, Range]]:
        """The buckets whose slices [start, stop) of the local shard meets, in order, each
        with the overlap (in local-shard elements; never empty). Only those buckets are
        visited: a scan of every bucket per tile made the step quadratic in the buckets
        (0.25 s of GPT-2 XL's step on a GPU)."""
        k = max(0, bisect.bisect_right(self._offsets, start) - 1)
        while k < len(self.buckets) and self._offsets[k] < stop:
            overlap = self.buckets[k].local_range.intersect(Range(start, max(start, stop)))
            if overlap.size > 0:
                yield self.buckets[k], overlap
            k += 1


@dataclass(eq=False)
class BucketTable(Generic[B]):
    """Every group's buckets; iterating gives every bucket in (group, bucket) order, the
    order every rank launches collectives in unless a component says otherwise."""

    groups: tuple[GroupBuckets[B], ...]

    def __iter__(self) -> Iterator[B]:
        return (bucket for group in self.groups for bucket in group)

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups)

    def at(self, group: int, index: int) -> B:
        """Bucket ``index`` of ``group`` (for callers that hold the two numbers: a
        ParamSlot's ``group`` and ``bucket``, a LocalPiece's ``bucket``)."""
        return self.groups[group].buckets[index]

    def of(self, slot: ParamSlot) -> B:
        """The bucket holding ``slot``."""
        return self.at(slot.group, slot.bucket)

    def map(self, make: Callable[[B], C]) -> BucketTable[C]:
        """A table of ``make(bucket)`` for every bucket, in the same places (a component
        turning geometry buckets into buckets with its state)."""
        return BucketTable(
            tuple(
                GroupBuckets(group.group, group.layout, tuple(make(b) for b in group))
                for group in self.groups
            )
        )


def build_buckets(layouts: Sequence[GroupLayout], table: ParamTable | None) -> BucketTable[Bucket]:
    """One geometry bucket per bucket of each layout, with the slots ``table`` placed in it
    (ParamTable.place must have run); no slots without a table."""
    groups, position = [], 0
    for g, layout in enumerate(layouts):
        buckets = []
        for k, geometry in enumerate(layout.buckets):
            slots: tuple[ParamSlot, ...] = ()
            if table is not None:
                members = table.by_group[g]
                slots = tuple(members[i] for i in sorted(geometry.param_indices))
            buckets.append(Bucket(g, k, position, geometry, slots))
            position += 1
        groups.append(GroupBuckets(g, layout, tuple(buckets)))
    return BucketTable(tuple(groups))
