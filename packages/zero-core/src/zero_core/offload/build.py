"""Build the offload tiers an engine's config asks for: the swap folder (checked before
anything is built), the tile plan, the disk pipeline, and the parameter shards' tier.

    offload_dir/zero-swap.rank{r}.pid{p}.{n}/   the swap files of this rank's n-th engine
                                                (removed when the engine is closed)

Each tier says at DEBUG (logger ``zero_core.offload.build``) what it built: the swap
folder, the tiles per tier and their elements, the buffers and I/O threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
from pathlib import Path

import torch

from zero_comm import Communicator

from ..config.zero_config import ZeroConfig
from ..group_layout import GroupLayout
from ..param_table import ParamTable
from .masters import OffloadedMasters
from .swap_file import SwapSpaceError, check_offload_dir
from .swapped_tiles import SwappedTiles
from .tiered_parameters import ParameterShards
from .tiers import Tier, TileSpec, plan_tiles

# Bytes per master element a disk tile needs: the float32 master and two float32 states
# (Adam's); an optimizer with more states makes its files when it first steps.
DISK_BYTES_PER_MASTER_ELEMENT = 12

log = logging.getLogger(__name__)


_ENGINES = itertools.count()


def swap_folder(config: ZeroConfig, rank: int) -> Path | None:
    """A folder no other engine uses, even one of this process not yet collected; None
    when nothing goes to disk."""
    if config.offload_dir is None or "disk" not in (
        config.offload_optimizer,
        config.offload_params,
    ):
        return None
    return Path(config.offload_dir) / f"zero-swap.rank{rank}.pid{os.getpid()}.{next(_ENGINES)}"


def first_names(
    layouts: list[GroupLayout], slots: ParamTable, rank: int, starts: list[tuple[int, int]]
) -> dict[tuple[int, int], str]:
    """For each (group, start in this rank's master), the name of the first parameter
    at or after it: what the swap file of a tile or slice is named by."""
    out: dict[tuple[int, int], str] = {}
    pieces = {g: layouts[g].local_pieces(rank) for g in {g for g, _ in starts}}
    for g, start in starts:
        name = "padding"
        for piece in pieces[g]:
            if piece.local_range.stop > start:
                name = slots.by_group[g][piece.param_index].name
                break
        out[(g, start)] = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:96]
    return out


def disk_bytes_needed(
    config: ZeroConfig, plan: list[list[TileSpec]] | None, layouts: list[GroupLayout],
    dtype: torch.dtype,
) -> int:  # fmt: skip
    total = 0
    if plan is not None:
        disk = sum(s.numel for specs in plan for s in specs if s.tier is Tier.DISK)
        total += disk * DISK_BYTES_PER_MASTER_ELEMENT
    if config.offload_params == "disk":
        total += sum(lay.shard_numel for lay in layouts) * dtype.itemsize
    return total


def build_offloaded_masters(
    layouts: list[GroupLayout],
    slots: ParamTable,
    rank: int,
    config: ZeroConfig,
    comm: Communicator,
    plan: list[list[TileSpec]],
    folder: Path | None,
) -> OffloadedMasters:
    """The master weights in the tiers of ``plan``, with a disk pipeline if any tile
    is on disk."""
    disk = [spec for specs in plan for spec in specs if spec.tier is Tier.DISK]
    swap = None
    if disk:
        names = first_names(layouts, slots, rank, [(s.group, s.start) for s in disk])
        swap = SwappedTiles(
            disk,
            [names[(s.group, s.start)] for s in disk],
            _needs(folder),
            buffer_count=config.offload_buffer_count,
            io_threads=config.offload_io_threads,
        )
    if log.isEnabledFor(logging.DEBUG):
        log.debug("[rank %d] offloaded masters (offload_optimizer=%s): %s", rank,
                  config.offload_optimizer, _tier_counts(plan))  # fmt: skip
        if swap is not None:
            log.debug("[rank %d] master swap pipeline: folder %s, %d buffers of up to %d "
                      "elements per state, %d I/O threads", rank, swap.folder,
                      config.offload_buffer_count, max(s.numel for s in disk),
                      config.offload_io_threads)  # fmt: skip
    return OffloadedMasters(layouts, rank, plan, comm.device, swap, config.offload_pin_memory)


def _tier_counts(plan: list[list[TileSpec]]) -> str:
    """Per tier, its tiles and their float32 elements, e.g. ``disk: 12 tiles, 3145728
    elements (12.0 MiB)``."""
    parts = []
    for tier in Tier:
        numels = [s.numel for specs in plan for s in specs if s.tier is tier]
        if numels:
            parts.append(f"{tier.name.lower()}: {len(numels)} tiles, {sum(numels)} "
                         f"elements ({_size(sum(numels) * 4)} of float32)")  # fmt: skip
    return "; ".join(parts) or "no tiles"


def _size(nbytes: int) -> str:
    """``nbytes`` for a person: ``512 B``, ``22.0 KiB``, ``1.5 GiB``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    raise AssertionError("unreachable")


def master_plan(layouts: list[GroupLayout], config: ZeroConfig) -> list[list[TileSpec]] | None:
    """The tile plan of offloaded masters, or None when they stay on the device."""
    if config.offload_optimizer == "none":
        return None
    return plan_tiles(
        layouts,
        tier=Tier(config.offload_optimizer),
        sub_group_numel=config.offload_sub_group_numel,
        fraction=config.offload_fraction,
    )


def check_space(
    config: ZeroConfig, plan: list[list[TileSpec]] | None, layouts: list[GroupLayout],
    dtype: torch.dtype, world: Communicator,
) -> None:  # fmt: skip
    """Collective over ``world``: refuse a missing, read-only or too small offload_dir
    before anything is built. The room asked for is what every rank writing into the same
    filesystem of this host needs, agreed by all of them first: each checking its own
    share alone once passed on a disk too small for both (then ENOSPC mid-build)."""
    if "disk" not in (config.offload_optimizer, config.offload_params):
        return
    assert config.offload_dir is not None
    needed = disk_bytes_needed(config, plan, layouts, dtype)
    log.debug("[rank %d] offload_dir %s: this rank's swap files need %d bytes (%s)",
              world.rank, config.offload_dir, needed, _size(needed))  # fmt: skip
    here = (socket.gethostname(), _filesystem(config.offload_dir))
    everyone = world.all_gather_object((here, needed))
    sharing = [bytes_ for where, bytes_ in everyone if where == here]
    try:
        check_offload_dir(config.offload_dir, sum(sharing))
    except SwapSpaceError as exc:
        if len(sharing) == 1:
            raise
        raise SwapSpaceError(
            f"[rank {world.rank}] {exc} ({len(sharing)} ranks of this host write there, "
            f"{needed} bytes each at most)"
        ) from None


def _filesystem(folder: str) -> int | None:
    """The device number of ``folder``'s filesystem (None if it cannot be read: the
    check that follows names why)."""
    try:
        return os.stat(folder).st_dev
    except OSError:
        return None


def build_parameter_shards(
    layouts: list[GroupLayout], slots: ParamTable, rank: int, config: ZeroConfig,
    comm: Communicator, dtype: torch.dtype, folder: Path | None,
) -> ParameterShards:  # fmt: skip
    tier = Tier(config.offload_params)
    slices = [b.slice_numel for lay in layouts for b in lay.buckets]
    if tier is not Tier.DISK:
        log.debug("[rank %d] parameter shards in the %s tier (offload_params=%s): %d bucket "
                  "slices, %d elements of %s (%s)", rank, tier.name.lower(),
                  config.offload_params, len(slices), sum(slices), dtype,
                  _size(sum(slices) * dtype.itemsize))  # fmt: skip
        return ParameterShards(layouts, rank, dtype, comm, tier, pin=config.offload_pin_memory)
    log.debug("[rank %d] parameter shards swapped (offload_params=disk): folder %s, %d swap "
              "files (one per bucket slice, %d elements of %s in all (%s), the largest %d), %d "
              "I/O threads", rank, folder, len(slices), sum(slices), dtype,
              _size(sum(slices) * dtype.itemsize), max(slices, default=0),
              config.offload_io_threads)  # fmt: skip
    starts = [(g, b.local_offset) for g, lay in enumerate(layouts) for b in lay.buckets]
    names = first_names(layouts, slots, rank, starts)
    labels = {
        (g, k): names[(g, b.local_offset)]
        for g, lay in enumerate(layouts)
        for k, b in enumerate(lay.buckets)
    }
    return ParameterShards(
        layouts, rank, dtype, comm, tier, folder=_needs(folder), labels=labels,
        pin=config.offload_pin_memory, io_threads=config.offload_io_threads,
    )  # fmt: skip


def _needs(folder: Path | None) -> Path:
    assert folder is not None, "a disk tier has a swap folder (swap_folder)"
    return folder
