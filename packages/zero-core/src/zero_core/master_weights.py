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
from typing import Any, Protocol

import torch
from torch import nn

from zero_comm import Communicator

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
        # Per group, the bucket of each tile (tiles are in bucket order).
        self.tile_buckets: list[list[int]] = []
        self.rank = rank
        self.aliased = aliases is not None
        # Separate masters: one float32 tensor per group, and its bucket slices.
        self.shards: list[nn.Parameter] = []
        self.slices: list[list[torch.Tensor]] = []
        if aliases is not None:
            self.slices = aliases
        else:
            for layout in layouts:
                shard = nn.Parameter(torch.zeros(layout.shard_numel, device=device))
                self.shards.append(shard)
                self.slices.append(
                    [
                        shard.detach()[b.local_offset : b.local_offset + b.slice_numel]
                        for b in layout.buckets
                    ]
                )
        self.tiles: list[list[Tile]] = [self._tiles(g) for g in range(len(layouts))]
        # Per group and bucket, the tiles of that bucket slice (every bucket has one at least).
        self.bucket_tiles: list[list[list[Tile]]] = [
            [
                [tile for tile, k in zip(tiles, buckets, strict=True) if k == bucket]
                for bucket in range(len(layout.buckets))
            ]
            for layout, tiles, buckets in zip(layouts, self.tiles, self.tile_buckets, strict=True)
        ]
        # Whether the parameters gather anything after a step (not at stage 0).
        self.sharded = any(layout.world_size > 1 for layout in layouts)

    def _tiles(self, group: int) -> list[Tile]:
        layout = self.layouts[group]
        limit = self.tile_numel
        if (
            not self.aliased
            and len(layout.buckets) <= 1
            and (limit is None or layout.shard_numel <= limit)
        ):
            shard = self.shards[group]
            self.tile_buckets.append([0])
            return [(shard, slice(0, shard.numel()))]
        tiles: list[Tile] = []
        buckets: list[int] = []
        for k, (b, values) in enumerate(zip(layout.buckets, self.slices[group], strict=True)):
            width = limit or max(b.slice_numel, 1)
            for a in range(0, max(b.slice_numel, 1), width):  # an empty slice: one tile
                stop = min(a + width, b.slice_numel)
                where = slice(b.local_offset + a, b.local_offset + stop)
                tiles.append((nn.Parameter(values[a:stop]), where))
                buckets.append(k)
        self.tile_buckets.append(buckets)
        return tiles

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """This rank's pieces of ``value`` (the whole float32 value of ``slot``'s
        parameter, flat) into separate masters; aliased ones are the parameters' own
        storage, which the parameters fill."""
        if self.aliased:
            return
        for piece in slot.pieces:
            bucket = self.layouts[slot.group].buckets[piece.bucket]
            local = piece.local_range.shift(bucket.local_offset)
            target = self.slices[slot.group][piece.bucket]
            target[local.start : local.stop] = value[
                piece.param_range.start : piece.param_range.stop
            ]

    def shard_pieces(self, group: int) -> list[MasterPiece]:
        """Which elements of which parameter sit where in this rank's master of ``group``."""
        return shard_pieces(self.layouts[group], self.rank)

    def full_values(self, comm: Communicator, slots: Iterable[ParamSlot]) -> list[torch.Tensor]:
        """Collective where the master is sharded: every slot's whole float32 value (in
        slot order, shaped like the parameter), on every rank."""
        return full_values(comm, self.layouts, slots, lambda g, k: self.slices[g][k])

    def write_back(
        self, slots: Iterable[ParamSlot], full_bucket: Callable[[int, int], torch.Tensor]
    ) -> None:
        """For each slot, the part in this rank's shard, from the full bucket (compute
        dtype; ``full_bucket(group, bucket)``) into the master, piece by piece."""
        for slot in slots:
            layout = self.layouts[slot.group]
            for piece in slot.pieces:
                local = piece.local_range.shift(layout.buckets[piece.bucket].local_offset)
                values = full_bucket(slot.group, piece.bucket)
                target = self.slices[slot.group][piece.bucket]
                target[local.start : local.stop] = values[
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
            for group, g in enumerate(gradients):
                for bucket, b in enumerate(self.layouts[group].buckets):
                    in_bucket = g[b.local_offset : b.local_offset + b.slice_numel]
                    self.step_bucket(optimizer, group, bucket, in_bucket, updated)
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
        offset = self.layouts[group].buckets[bucket].local_offset
        members = self.bucket_tiles[group][bucket]
        step_part(
            optimizer,
            [
                (tile, gradient[(where.start or 0) - offset : (where.stop or 0) - offset])
                for tile, where in members
            ],
        )
        for tile, where in members:
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
    layouts: list[GroupLayout],
    slots: Iterable[ParamSlot],
    bucket_slice: Callable[[int, int], torch.Tensor],
) -> list[torch.Tensor]:
    """Collective: every slot's whole float32 value (slot order, shaped like the
    parameter), on every rank, all-gathered bucket by bucket from each rank's
    ``bucket_slice(group, bucket)`` (float32); a layout of one rank is its own."""
    fulls: list[list[torch.Tensor]] = []
    for g, layout in enumerate(layouts):
        fulls.append([])
        for k, bucket in enumerate(layout.buckets):
            mine = bucket_slice(g, k)
            if layout.world_size == 1:
                fulls[-1].append(mine)
                continue
            full = torch.empty(bucket.layout.padded_numel, device=mine.device)
            comm.all_gather(full, mine)
            fulls[-1].append(full)
    return [fulls[s.group][s.bucket][s.flat.start : s.flat.stop].view(s.shape) for s in slots]


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
