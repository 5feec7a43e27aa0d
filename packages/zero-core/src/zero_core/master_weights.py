"""The float32 master weights one rank holds, and the tiles the optimizer steps.

Per optimizer group, the master is this rank's local shard of the group's layout (the
whole group where the layout has one rank: stage 0), one bucket slice after another:

    group layout, rank 1 of 4      bucket 0 slice     bucket 1 slice
    master (float32)             | m m m m m m m m | m m m m |      = local shard
    tiles (optimizer tensors)    | tile 0          | tile 1  |      one per bucket slice

*Separate* masters are float32 tensors of their own. *Aliased* masters (float32 compute)
are the parameters' own storage: each bucket slice is this rank's slice of the parameter
bucket (stages 0-2) or of the compute shard (stage 3), so the optimizer's in-place update
lands in the parameters and there is one copy of the weights, not two.

A group of one bucket with a master tensor of its own is stepped as one tile; otherwise
one tile per bucket slice, so the optimizer's temporaries are bounded by a bucket. On the
CPU a bucket slice is cut further, into tiles of at most ``CPU_TILE_NUMEL`` elements:

    bucket slice (float32)       | t0   | t1   | t2   | t3 |   each <= CPU_TILE_NUMEL

torch's CPU optimizers make several passes over each tensor (AdamW's for-loop: about
eight), and a tile that fits the cache makes every pass after the first a cache hit: one
AdamW step over 19.1M float32 elements took 280 ms as one tensor, 221 ms as 5 and 111 ms
as 60 (1 thread, AMD EPYC). The bits do not depend on the cut (the optimizers of
optimizer_parts are elementwise per tensor, and every tensor's state is its own).
Every tile lies within one bucket slice, so the optimizer can be stepped bucket by bucket
while the parameters gather the buckets already stepped (``step``, optimizer_parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zero_comm import Communicator

from .buckets import B, Bucket, BucketTable, GroupBuckets, build_buckets
from .checkpoint.sharded_state import MasterPiece
from .group_layout import GroupLayout
from .memory.report import optimizer_state_bytes, tensor_bytes
from .optimizer_parts import step_part, steps_in_parts
from .param_table import ParamSlot
from .reduced_gradient import GroupGradient

Tile = tuple[torch.Tensor, slice]  # an optimizer tensor and where it sits in the master
# On the CPU: the most elements of one tile (1 MiB of float32, a few L2 caches' worth).
CPU_TILE_NUMEL = 2**18
# Called with each tile's updated values: (group, start in the master, float32 values).
TileVisitor = Callable[[int, int, torch.Tensor], None]


@dataclass(eq=False)
class MasterBucket(Bucket):
    """A bucket's part of this rank's master: ``values`` (float32, slice_numel elements: a
    view of the group's separate master, or the aliased compute slice) and ``tiles`` (the
    optimizer tensors over it, in order: views of ``values``, or the group's whole master
    when that is one tile)."""

    values: torch.Tensor
    tiles: list[Tile] = field(default_factory=list)


class VisitsTiles(Protocol):
    """Master weights of any tier, as the parameters see them after a write-back."""

    def visit(self, updated: TileVisitor) -> None: ...


class MasterWeights:
    """This rank's float32 master weights of every group; see the module docstring."""

    def __init__(
        self,
        layouts: list[GroupLayout],
        rank: int,
        aliases: list[list[torch.Tensor]] | None,
        device: torch.device,
    ) -> None:
        """``aliases``: per group and bucket, the float32 compute slice that is the master
        (aliased masters); None for separate float32 masters, allocated here (zeros)."""
        self.layouts = layouts
        self.tile_numel = CPU_TILE_NUMEL if device.type == "cpu" else None
        self.rank = rank
        self.aliased = aliases is not None
        # Separate masters: one float32 tensor per group; each bucket's values view it.
        self.shards: list[nn.Parameter] = []
        if aliases is None:
            for layout in layouts:
                self.shards.append(nn.Parameter(torch.zeros(layout.shard_numel, device=device)))
        aliased = [values for group in aliases or [] for values in group]

        def master_bucket(bucket: Bucket) -> MasterBucket:
            if aliases is not None:
                values = aliased[bucket.position]
            else:
                values = self.shards[bucket.group].detach()[bucket.local_offset :]
                values = values[: bucket.slice_numel]
            return MasterBucket(*bucket.base(), values=values)

        self.buckets: BucketTable[MasterBucket] = build_buckets(layouts, None).map(master_bucket)
        # Per group, every tile in order (each bucket also lists its own).
        self.tiles: list[list[Tile]] = [self._tiles(group) for group in self.buckets.groups]
        # Whether the parameters gather anything after a step (not at stage 0).
        self.sharded = any(layout.world_size > 1 for layout in layouts)

    def _tiles(self, group: GroupBuckets[MasterBucket]) -> list[Tile]:
        """The tiles of one group, each also listed by its bucket."""
        limit = self.tile_numel
        if (
            not self.aliased
            and len(group) <= 1
            and (limit is None or group.layout.shard_numel <= limit)
        ):
            shard = self.shards[group.group]
            whole = (shard, slice(0, shard.numel()))
            for bucket in group:  # the one bucket, if any, is stepped as the whole master
                bucket.tiles.append(whole)
            return [whole]
        tiles: list[Tile] = []
        for bucket in group:
            width = limit or max(bucket.slice_numel, 1)
            for a in range(0, max(bucket.slice_numel, 1), width):  # an empty slice: one tile
                stop = min(a + width, bucket.slice_numel)
                where = slice(bucket.local_offset + a, bucket.local_offset + stop)
                bucket.tiles.append((nn.Parameter(bucket.values[a:stop]), where))
            tiles += bucket.tiles
        return tiles

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """This rank's pieces of ``value`` (the whole float32 value of ``slot``'s
        parameter, flat) into separate masters; aliased ones are the parameters' own
        storage, which the parameters fill."""
        if self.aliased:
            return
        bucket = self.buckets.of(slot)  # a parameter lies in one bucket
        for piece in slot.pieces:
            local = piece.local_range.shift(bucket.local_offset)
            bucket.values[local.start : local.stop] = value[
                piece.param_range.start : piece.param_range.stop
            ]

    def shard_pieces(self, group: int) -> list[MasterPiece]:
        """Which elements of which parameter sit where in this rank's master of ``group``."""
        return shard_pieces(self.layouts[group], self.rank)

    def full_values(self, comm: Communicator, slots: Iterable[ParamSlot]) -> list[torch.Tensor]:
        """Collective where the master is sharded: every slot's whole float32 value (in
        slot order, shaped like the parameter), on every rank."""
        return full_values(comm, self.buckets, slots, lambda bucket: bucket.values)

    def write_back(
        self, slots: Iterable[ParamSlot], full_bucket: Callable[[int, int], torch.Tensor]
    ) -> None:
        """For each slot, the part in this rank's shard, from the full bucket (compute
        dtype; ``full_bucket(group, bucket)``) into the master, piece by piece."""
        for slot in slots:
            bucket = self.buckets.of(slot)  # a parameter lies in one bucket
            for piece in slot.pieces:
                local = piece.local_range.shift(bucket.local_offset)
                values = full_bucket(bucket.group, bucket.index)
                bucket.values[local.start : local.stop] = values[
                    piece.flat_range.start : piece.flat_range.stop
                ]

    # ------------------------------------------------------------ the step
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: list[GroupGradient],
        updated: TileVisitor,
        *,
        bucket_by_bucket: bool = False,
    ) -> None:
        """Step ``optimizer`` over every tile with its slice of ``gradients`` (float32,
        one per group, laid out like the master) and hand the tiles' new values to
        ``updated``, in group and bucket order.

        With ``bucket_by_bucket`` (the parameters gather a bucket as soon as its values
        are handed over), a master sharded over more than one rank and an optimizer that
        optimizer_parts allows: one ``optimizer.step()`` per bucket slice (its tiles),
        each tile handed over right after that step, aliased or not (an aliased tile's
        values already are the parameters'; the call says they are final). Otherwise one
        ``optimizer.step()`` over every tile, then every tile handed over (not for
        aliased masters: the parameters are those values). Both give the same bits."""
        if bucket_by_bucket and self.sharded and steps_in_parts(optimizer):
            for bucket in self.buckets:
                local = bucket.local_range
                in_bucket = gradients[bucket.group][local.start : local.stop]
                self._step_bucket(optimizer, bucket, in_bucket, updated)
            return
        step_part(
            optimizer,
            [
                (tile, g[where])
                for tiles, g in zip(self.tiles, gradients, strict=True)
                for tile, where in tiles
            ],
        )
        if not self.aliased:
            self.visit(updated)

    def step_bucket(
        self,
        optimizer: torch.optim.Optimizer,
        group: int,
        bucket: int,
        gradient: torch.Tensor,
        updated: TileVisitor,
    ) -> None:
        """One ``optimizer.step()`` over the tiles of one bucket slice of ``group``, with
        ``gradient`` (float32, that slice's elements), each tile then handed to ``updated``:
        the part ``step(..., bucket_by_bucket=True)`` takes for each bucket, and
        optimizer_in_backward for the bucket just reduced (the optimizer must step in
        parts: optimizer_parts)."""
        self._step_bucket(optimizer, self.buckets.at(group, bucket), gradient, updated)

    def _step_bucket(
        self,
        optimizer: torch.optim.Optimizer,
        bucket: MasterBucket,
        gradient: torch.Tensor,
        updated: TileVisitor,
    ) -> None:
        offset, group = bucket.local_offset, bucket.group
        step_part(
            optimizer,
            [
                (tile, gradient[(where.start or 0) - offset : (where.stop or 0) - offset])
                for tile, where in bucket.tiles
            ],
        )
        for tile, where in bucket.tiles:
            updated(group, where.start or 0, tile.detach().view(-1))

    def visit(self, updated: TileVisitor) -> None:
        """Hand every tile's values to ``updated``, in order."""
        for g, tiles in enumerate(self.tiles):
            for tile, where in tiles:
                updated(g, where.start or 0, tile.detach().view(-1))

    def finish_fill(self) -> None:
        return None

    # ---------------------------------------------------------- checkpoints
    def group_state(
        self, group: int, optimizer: torch.optim.Optimizer
    ) -> tuple[list[tuple[torch.Tensor, slice]], list[dict[str, Any]]]:
        """The master tiles of ``group`` (flat views) and each tile's optimizer state."""
        tiles = self.tiles[group]
        return (
            [(tile.detach().view(-1), where) for tile, where in tiles],
            [optimizer.state.get(tile, {}) for tile, _ in tiles],
        )

    def load_group_state(
        self,
        group: int,
        master_tiles: list[tuple[torch.Tensor, slice]],
        tile_states: list[dict[str, Any]],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Copy ``master_tiles`` in (unless they are these tiles' own views) and make
        ``tile_states`` the optimizer's state; shapes are checked."""
        load_tiles(group, self.tiles[group], master_tiles, tile_states, optimizer)

    # --------------------------------------------------------------- report
    @property
    def bytes(self) -> int:
        """Bytes of separate masters on the device (aliased ones are counted as
        parameters)."""
        return 0 if self.aliased else tensor_bytes(self.shards)

    def tier_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
        """(optimizer-state bytes on the device, bytes in host memory, bytes on disk)."""
        return optimizer_state_bytes(optimizer), 0, 0

    def close(self) -> None:
        return None


def shard_pieces(layout: GroupLayout, rank: int) -> list[MasterPiece]:
    """Which elements of which parameter sit where in ``rank``'s master of a group."""
    return [
        MasterPiece(p.param_index, p.param_range, p.local_range.start)
        for p in layout.local_pieces(rank)
    ]


def full_values(
    comm: Communicator,
    buckets: BucketTable[B],
    slots: Iterable[ParamSlot],
    bucket_slice: Callable[[B], torch.Tensor],
) -> list[torch.Tensor]:
    """Collective: every slot's whole float32 value (slot order, shaped like the
    parameter), on every rank, all-gathered bucket by bucket (in (group, bucket) order)
    from each rank's ``bucket_slice(bucket)`` (float32); a bucket of one rank is its own."""
    fulls: list[torch.Tensor] = []  # by bucket position
    for bucket in buckets:
        mine = bucket_slice(bucket)
        if bucket.layout.world_size == 1:
            fulls.append(mine)
            continue
        full = torch.empty(bucket.padded_numel, device=mine.device)
        comm.all_gather(full, mine)
        fulls.append(full)
    return [fulls[buckets.of(s).position][s.flat.start : s.flat.stop].view(s.shape) for s in slots]


def check_tile_counts(
    group: int,
    tiles: list[Tile],
    master_tiles: list[tuple[torch.Tensor, slice]],
    tile_states: list[dict[str, Any]],
) -> None:
    if len(master_tiles) != len(tiles) or len(tile_states) != len(tiles):
        raise ValueError(
            f"group {group}: {len(master_tiles)} master tiles and {len(tile_states)} tile "
            f"states given for {len(tiles)} tiles"
        )
    for (source, _), (_, where) in zip(master_tiles, tiles, strict=True):
        numel = (where.stop or 0) - (where.start or 0)
        if source.numel() != numel:
            raise ValueError(
                f"group {group}: a master tile of {source.numel()} elements given for one "
                f"of {numel}"
            )


def load_tiles(
    group: int,
    tiles: list[Tile],
    master_tiles: list[tuple[torch.Tensor, slice]],
    tile_states: list[dict[str, Any]],
    optimizer: torch.optim.Optimizer,
) -> None:
    """Resident tiles: copy ``master_tiles`` in and set the optimizer's state."""
    check_tile_counts(group, tiles, master_tiles, tile_states)
    for (source, _), (tile, _) in zip(master_tiles, tiles, strict=True):
        target = tile.detach().view(-1)
        if source.data_ptr() != target.data_ptr():
            target.copy_(source.view(-1))
    for (tile, _), tile_state in zip(tiles, tile_states, strict=True):
        if tile_state:
            optimizer.state[tile] = dict(tile_state)
        else:
            optimizer.state.pop(tile, None)
