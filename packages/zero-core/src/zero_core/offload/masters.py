"""Master weights and optimizer states outside the device (ZeRO-Offload, ZeRO-Infinity):
the same contract as master_weights.MasterWeights, with each tile in a tier.

    this rank's master of group g     | t0 DEVICE | t1 HOST | t2 DISK | t3 DISK |
    the optimizer steps               t0 and t1 at once (resident tiles), then t2, t3
                                      one at a time through the swap pipeline
    updated(g, start, values)         each tile's new values, as it is stepped

The tiles, their tiers and the pipeline are in offload_tiers and swapped_tiles. A disk
tile's optimizer state lives in the optimizer's ``state`` only while the tile is stepped
(its tensors are views of a pipeline buffer); in between, its tensors are in swap files
and its scalars (Adam's step) here. The optimizer must create its state lazily (at its
first step), as Adam, AdamW, SGD and RMSprop do: one that fills it at construction
(Adagrad) would hold every disk tile's state in memory, and is refused.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zero_comm import Communicator
from zero_comm.profiler_ranges import profiler_range

from ..buckets import Bucket, build_buckets
from ..checkpoint.sharded_state import MasterPiece
from ..group_layout import GroupLayout
from ..master_weights import (
    Tile,
    TileVisitor,
    check_tile_counts,
    full_values,
    load_tiles,
    shard_pieces,
)
from ..memory.report import tensor_bytes
from ..param_table import ParamSlot
from ..reduced_gradient import GroupGradient, ShardGradient
from .partial_blocks import PartialBlocks
from .swapped_tiles import MASTER, ResidentTile, SwappedTiles
from .tiers import Tier, TileSpec, host_device, host_empty

Placement = tuple[Tier, int]  # (tier, index into the tier's own list of tiles)


class OffloadedMasters:
    """This rank's float32 master weights, tile by tile in their tiers."""

    aliased = False

    def __init__(
        self,
        layouts: list[GroupLayout],
        rank: int,
        plan: list[list[TileSpec]],
        device: torch.device,
        swap: SwappedTiles | None,
        pin: bool,
    ) -> None:
        self.layouts = layouts
        self.buckets = build_buckets(layouts, None)
        self.rank = rank
        self.plan = plan
        self.device = device
        self.swap = swap
        self.tiles: list[list[Tile]] = []
        self.disk_tiles: list[nn.Parameter] = []  # the optimizer's tensor of each disk tile
        self._starts = [[spec.start for spec in specs] for specs in plan]
        for specs in plan:
            self.tiles.append([])
            for spec in specs:
                if spec.tier is Tier.DISK:
                    tile = nn.Parameter(torch.empty(0, device=host_device()))
                    self.disk_tiles.append(tile)
                elif spec.tier is Tier.HOST:
                    tile = nn.Parameter(host_empty(spec.numel, torch.float32, device, pin).zero_())
                else:
                    tile = nn.Parameter(torch.zeros(spec.numel, device=device))
                self.tiles[-1].append((tile, spec.where))
        self._tile_of = {
            (spec.group, spec.start): tile
            for specs, tiles in zip(plan, self.tiles, strict=True)
            for spec, (tile, _) in zip(specs, tiles, strict=True)
        }
        self._disk_index: dict[tuple[int, int], int] = {}
        for specs in plan:
            for spec in specs:
                if spec.tier is Tier.DISK:
                    self._disk_index[(spec.group, spec.start)] = len(self._disk_index)
        if swap is not None:
            numels: dict[Any, int] = {i: spec.numel for i, spec in enumerate(swap.specs)}
            expected = dict.fromkeys(numels, 0)
            for g, layout in enumerate(layouts):
                for piece in layout.local_pieces(rank):
                    for spec, a, b in self._overlaps(
                        g, piece.local_range.start, piece.local_range.stop
                    ):
                        if spec.tier is Tier.DISK:
                            expected[self._disk_index[(g, spec.start)]] += b - a
            self._filling = PartialBlocks(numels, expected, torch.float32, self._write_master)

    def _write_master(self, index: Any, values: torch.Tensor) -> None:
        assert self.swap is not None
        self.swap.write(index, MASTER, values)

    def _overlaps(self, group: int, start: int, stop: int) -> Iterable[tuple[TileSpec, int, int]]:
        """The tiles of ``group`` that [start, stop) of its master meets, with the overlap."""
        specs = self.plan[group]
        position = max(0, bisect_right(self._starts[group], start) - 1)
        while position < len(specs) and specs[position].start < stop:
            spec = specs[position]
            a, b = max(start, spec.start), min(stop, spec.stop)
            if a < b:
                yield spec, a, b
            position += 1

    def disk_index(self, spec: TileSpec) -> int:
        """The index of disk tile ``spec`` in the swap pipeline."""
        return self._disk_index[(spec.group, spec.start)]

    def _tile(self, spec: TileSpec) -> torch.Tensor:
        return self._tile_of[(spec.group, spec.start)]

    # ------------------------------------------------------------- build
    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """This rank's pieces of ``value`` (float32, whole, flat) into their tiles."""
        for piece in slot.pieces:
            local = piece.local_range
            for spec, a, b in self._overlaps(slot.group, local.start, local.stop):
                part = value[piece.param_range.start + a - local.start :][: b - a]
                if spec.tier is Tier.DISK:
                    index = self._disk_index[(slot.group, spec.start)]
                    self._filling.write(index, a - spec.start, part)
                else:
                    self._tile(spec).detach()[a - spec.start : b - spec.start] = part

    def finish_fill(self) -> None:
        if self.swap is not None:
            self._filling.finish()

    def shard_pieces(self, group: int) -> list[MasterPiece]:
        return shard_pieces(self.layouts[group], self.rank)

    # -------------------------------------------------------------- step
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: list[GroupGradient],
        updated: TileVisitor,
        *,
        bucket_by_bucket: bool = False,
    ) -> None:
        """Step the resident tiles at once, then the disk tiles one at a time through the
        pipeline; each tile's new values go to ``updated`` as they are ready (so the
        parameters gather the resident buckets while the disk tiles are stepped).

        ``bucket_by_bucket`` is not taken up here: the resident tiles may sit on two
        devices (DEVICE and HOST tiers), and torch picks the optimizer's implementation
        from the devices of the tensors of one call, so one call per tile could pick
        another one than the call over all of them."""
        del bucket_by_bucket
        resident = [
            (spec, tile) for specs, tiles in zip(self.plan, self.tiles, strict=True)
            for spec, (tile, _) in zip(specs, tiles, strict=True) if spec.tier is not Tier.DISK
        ]  # fmt: skip
        for spec, tile in resident:
            tile.grad = gradients[spec.group][spec.where].to(tile.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host grads have landed
        if resident:
            with profiler_range("optimizer_step"):
                optimizer.step()
        for spec, tile in resident:
            tile.grad = None
            updated(spec.group, spec.start, tile.detach())
        if self.swap is None:
            return
        swap = self.swap

        def step_one(resident_tile: ResidentTile) -> None:
            index = resident_tile.index
            spec, tile = swap.specs[index], self.disk_tiles[index]
            tile.data = resident_tile.master
            state: dict[str, Any] = {**resident_tile.states, **swap.scalars[index]}
            if state:
                optimizer.state[tile] = state
            tile.grad = _disk_tile_gradient(gradients[spec.group], spec, resident_tile)
            try:
                with profiler_range("optimizer_step"):
                    optimizer.step()
            finally:
                tile.grad = None
                after = optimizer.state.pop(tile, {})
                tile.data = tile.data.new_empty(0)
            scalars = {}
            for key, value in after.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.numel() != spec.numel:
                        raise RuntimeError(
                            f"optimizer state {key!r} has {value.numel()} elements for a tile "
                            f"of {spec.numel}: offloading needs an elementwise optimizer"
                        )
                    resident_tile.keep(key, value)
                else:
                    scalars[key] = value
            swap.scalars[index] = scalars
            updated(spec.group, spec.start, resident_tile.master)

        swap.stream(step_one, write=True, states=True, gradients=True)

    def visit(self, updated: TileVisitor) -> None:
        """Hand every tile's values to ``updated``, in tier order."""
        for specs, tiles in zip(self.plan, self.tiles, strict=True):
            for spec, (tile, _) in zip(specs, tiles, strict=True):
                if spec.tier is not Tier.DISK:
                    updated(spec.group, spec.start, tile.detach())
        if self.swap is not None:
            swap = self.swap

            def hand_over(tile: ResidentTile) -> None:
                spec = swap.specs[tile.index]
                updated(spec.group, spec.start, tile.master)

            swap.stream(hand_over, write=False, states=False)

    # ------------------------------------------------------- whole values
    def _read_master(self, spec: TileSpec) -> torch.Tensor:
        """A tile's values, resident (a copy for a disk tile)."""
        if spec.tier is not Tier.DISK:
            return self._tile(spec).detach()
        assert self.swap is not None
        values = torch.empty(spec.numel, device="cpu")
        self.swap.read(self._disk_index[(spec.group, spec.start)], MASTER, values)
        return values

    def bucket_slice(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket``, assembled from its tiles (float32, device)."""
        start = bucket.local_offset
        out = torch.empty(bucket.slice_numel, device=self.device)
        for spec, a, b in self._overlaps(bucket.group, start, start + bucket.slice_numel):
            out[a - start : b - start] = self._read_master(spec)[a - spec.start : b - spec.start]
        return out

    def full_values(self, comm: Communicator, slots: Iterable[ParamSlot]) -> list[torch.Tensor]:
        """Collective where the master is sharded: every slot's whole float32 value."""
        return full_values(comm, self.buckets, slots, self.bucket_slice)

    def write_back(
        self, slots: Iterable[ParamSlot], full_bucket: Callable[[int, int], torch.Tensor]
    ) -> None:
        """For each slot, the part in this rank's shard, from the full bucket into the
        master (a disk tile is read, changed and written back)."""
        edits: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for slot in slots:
            for piece in slot.pieces:
                values = full_bucket(slot.group, piece.bucket)[
                    piece.flat_range.start : piece.flat_range.stop
                ]
                local = piece.local_range
                for spec, a, b in self._overlaps(slot.group, local.start, local.stop):
                    part = values[a - local.start : b - local.start]
                    if spec.tier is Tier.DISK:
                        index = self._disk_index[(slot.group, spec.start)]
                        edits.setdefault(index, []).append((a - spec.start, part))
                    else:
                        self._tile(spec).detach()[a - spec.start : b - spec.start] = part
        for index, changes in edits.items():
            assert self.swap is not None
            master = torch.empty(self.swap.specs[index].numel, device="cpu")
            self.swap.read(index, MASTER, master)
            for offset, part in changes:
                master[offset : offset + part.numel()] = part
            self.swap.write(index, MASTER, master)

    # -------------------------------------------------------- checkpoints
    def group_state(
        self, group: int, optimizer: torch.optim.Optimizer
    ) -> tuple[list[tuple[torch.Tensor, slice]], list[dict[str, Any]]]:
        """Master tiles and tile states of ``group``: views for resident tiles, copies
        read from the swap files for disk tiles (so a save holds this rank's disk-tier
        states in host memory for its duration)."""
        masters: list[tuple[torch.Tensor, slice]] = []
        states: list[dict[str, Any]] = []
        for spec, (tile, where) in zip(self.plan[group], self.tiles[group], strict=True):
            if spec.tier is not Tier.DISK:
                masters.append((tile.detach().view(-1), where))
                states.append(optimizer.state.get(tile, {}))
                continue
            assert self.swap is not None
            index = self._disk_index[(group, spec.start)]
            masters.append((self._read_master(spec), where))
            state: dict[str, Any] = {}
            for key in self.swap.keys[index]:
                value = torch.empty(spec.numel, dtype=self.swap.dtype_of(index, key), device="cpu")
                self.swap.read(index, key, value)
                state[key] = value
            for key, value in self.swap.scalars[index].items():
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            states.append(state)
        return masters, states

    def load_group_state(
        self,
        group: int,
        master_tiles: list[tuple[torch.Tensor, slice]],
        tile_states: list[dict[str, Any]],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Resident tiles as master_weights.load_tiles; disk tiles into their files."""
        tiles = self.tiles[group]
        check_tile_counts(group, tiles, master_tiles, tile_states)
        specs = self.plan[group]
        resident = [i for i, spec in enumerate(specs) if spec.tier is not Tier.DISK]
        load_tiles(
            group,
            [tiles[i] for i in resident],
            [master_tiles[i] for i in resident],
            [tile_states[i] for i in resident],
            optimizer,
        )
        for spec, (source, _), tile_state in zip(specs, master_tiles, tile_states, strict=True):
            if spec.tier is not Tier.DISK:
                continue
            assert self.swap is not None
            index = self._disk_index[(group, spec.start)]
            self.swap.write(index, MASTER, source.reshape(-1).contiguous())
            self.swap.keys[index] = []
            scalars = {}
            for key, value in tile_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    self.swap.write(index, key, value.reshape(-1).contiguous())
                    self.swap.keys[index].append(key)
                else:
                    scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
            self.swap.scalars[index] = scalars

    # ------------------------------------------------------------- report
    def _resident(self, tier: Tier) -> list[nn.Parameter]:
        return [
            tile
            for specs, tiles in zip(self.plan, self.tiles, strict=True)
            for spec, (tile, _) in zip(specs, tiles, strict=True)
            if spec.tier is tier and isinstance(tile, nn.Parameter)
        ]

    @property
    def bytes(self) -> int:
        """Bytes of master tiles on the device."""
        return tensor_bytes(self._resident(Tier.DEVICE))

    def tier_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
        """(optimizer-state bytes on the device, bytes in host memory, bytes on disk)."""

        def states(tier: Tier) -> int:
            return tensor_bytes(
                value
                for tile in self._resident(tier)
                for value in optimizer.state.get(tile, {}).values()
                if isinstance(value, torch.Tensor)
            )

        host = tensor_bytes(self._resident(Tier.HOST)) + states(Tier.HOST)
        disk = 0
        if self.swap is not None:
            host += self.swap.buffer_bytes
            disk = self.swap.disk_bytes
        return states(Tier.DEVICE), host, disk

    def close(self) -> None:
        if self.swap is not None:
            self.swap.close()


def _disk_tile_gradient(
    gradient: GroupGradient, spec: TileSpec, resident: ResidentTile
) -> torch.Tensor:
    """A disk tile's float32 gradient on the host: read with its master and states when
    it was offloaded (gradient_tier; scaled as the step scaled the rest), else its part
    of the device gradient, copied."""
    if isinstance(gradient, ShardGradient) and gradient.away_at(spec.where) is not None:
        if resident.gradient is None:
            raise RuntimeError(
                f"disk tile {resident.index} (group {spec.group}, elements {spec.start}:"
                f"{spec.stop}) has no gradient block of this step: a bug in the engine's "
                "gradient bookkeeping; nothing was stepped on it"
            )
        return gradient.finished(resident.gradient)
    return gradient[spec.where].to(host_device())
