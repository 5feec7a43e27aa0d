"""What one rank holds of the training state, as plain data: the contract between an engine
(:meth:`Engine.sharded_state`, :meth:`Engine.load_sharded_state`) and whatever saves or
restores it (writer.save, loader.load), which read this and the communicator, nothing else.

Per optimizer group, the rank's float32 master is a flat tensor that the optimizer steps
in *tiles* (views, in order; one tile at stage 0, one per bucket slice at stages 1-3),
and the master and every optimizer state as large as it are laid out by *pieces*:

    MasterPiece(param=i, elements=Range(a, b), offset=o)
        elements [a, b) of parameter i of the group (flattened) sit at [o, o + b - a)

    16 elements, 2 parameters (p0: 10, p1: 6), N = 2, one bucket, no padding:
        rank 0 master | p0[0:8]         |   pieces (0, [0, 8), 0)
        rank 1 master | p0[8:10] p1[0:6] |   pieces (0, [8, 10), 0), (1, [0, 6), 2)

Stage 0 ranks all hold the whole master (``replicated``): one copy is enough to save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from zero_comm.determinism import Fingerprint

from ..flat_layout import Range


class MasterPiece(NamedTuple):
    """Elements ``elements`` of parameter ``param`` (its index in the group) at
    ``offset`` in the rank's flat master of that group."""

    param: int
    elements: Range
    offset: int


@dataclass
class ShardedGroupState:
    """One optimizer group's part of this rank's state.

    ``master_tiles``: (flat float32 view, where it sits in the group's master), covering
    the master in order; writing into a view from :meth:`Engine.sharded_state`
    writes into the engine. ``tile_states``: the optimizer's state of each tile, as
    ``optimizer.state[tile]`` holds it (tensors shaped like the tile, and scalars such as
    Adam's step); empty dicts before the first step."""

    params: list[tuple[str, tuple[int, ...]]]  # name and shape of each parameter
    pieces: list[MasterPiece]
    master_tiles: list[tuple[torch.Tensor, slice]]
    tile_states: list[dict[str, Any]]
    options: dict[str, Any]  # the param group's hyper-parameters (lr, betas, ...)

    @property
    def numel(self) -> int:
        return sum(tile.numel() for tile, _ in self.master_tiles)


@dataclass
class ShardedState:
    """This rank's whole training state, and what a checkpoint records of how it was made.

    ``whole``: what every rank holds whole (frozen parameters and buffers, by state-dict
    name; :meth:`Engine.whole_tensors`), the engine's own tensors, not copies.
    ``first_replica``: this rank writes its slices; False on the later replicas of a
    hybrid-sharding shard group, which hold the same slices."""

    groups: list[ShardedGroupState]
    replicated: bool  # every rank holds the same master and states (stage 0)
    optimizer: str  # the optimizer's class name
    global_steps: int
    skipped_steps: int
    stage: int
    param_dtype: torch.dtype  # the compute dtype
    fingerprint: Fingerprint  # what this rank's bits depend on (zero_comm.determinism)
    whole: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> first name
    first_replica: bool = True
    loss_scaler: dict[str, float | int] = field(default_factory=dict)
    lr_scheduler: dict[str, Any] | None = None  # the scheduler's state_dict(), if any
    # ZeroConfig.shard_weights of the saving run (None: even shards). The pieces say where
    # every element is; this names why a rank holds more of them (zero_core.uneven_shards).
    shard_weights: tuple[float, ...] | None = None
