"""One parameter's whole float32 value, gradient or optimizer state, assembled from the
ranks' shards: DeepSpeed's ``safe_get_full_*`` over the core engine.

Each rank writes the pieces of the parameter it holds (``slot.pieces``: where they sit in
the parameter and in its shard) into a zero tensor of the parameter's size, and the ranks
sum these over the shard group: the pieces are disjoint, so the sum is the whole value,
exact (adding zeros rounds nothing). Where the states are not sharded (stage 0) every
rank has the whole value and nothing is exchanged. So each call is collective at stages
1-3: every rank must make it, for the same parameter, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...allreduced_gradients import AllReducedGradients
from ...engine import Engine
from ...flat_layout import Range
from ...param_owner import owner
from ...param_table import ParamSlot
from ...reduce_scattered_gradients import ReduceScatteredGradients
from ...reduced_gradient import has_storage
from ..unsupported import unsupported

# A piece's values from its range in this rank's shard of the group (local coordinates).
PieceReader = Callable[[Range], torch.Tensor]


def owned(param: nn.Parameter) -> tuple[Engine, ParamSlot] | None:
    """The engine training ``param`` and its slot; None for a parameter no facade
    engine trains (DeepSpeed returns None for those too)."""
    engine = owner(param)
    if engine is None:
        return None
    return engine, engine.slots.slot(param)


def assemble(engine: Engine, slot: ParamSlot, read: PieceReader) -> torch.Tensor:
    """Collective where the group is sharded: ``slot``'s whole value in float32, shaped
    like the parameter, from each rank's pieces (module doc)."""
    device = engine.comm.device
    whole = torch.zeros(slot.numel, dtype=torch.float32, device=device)
    for piece in slot.pieces:
        values = read(piece.local_range)
        whole[piece.param_range.start : piece.param_range.stop] = values.to(device, torch.float32)
    if engine.layouts[slot.group].world_size > 1:
        engine.shard_comm.all_reduce(whole, label="safe_get_full value")
    return whole.view(slot.shape)


def tile_reader(tiles: list[tuple[torch.Tensor, slice]]) -> PieceReader:
    """Read a local range from tiles (flat tensors and where each sits in the shard)."""

    def read(local: Range) -> torch.Tensor:
        parts = []
        for tile, where in tiles:
            start, stop = max(local.start, where.start or 0), min(local.stop, where.stop or 0)
            if start < stop:
                offset = where.start or 0
                parts.append(tile.reshape(-1)[start - offset : stop - offset])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    return read


def full_master(engine: Engine, slot: ParamSlot) -> torch.Tensor:
    """``slot``'s float32 master value, whole (collective where sharded)."""
    tiles, _ = engine.masters.group_state(slot.group, engine.optimizer)
    return assemble(engine, slot, tile_reader(tiles))


def full_optimizer_state(engine: Engine, slot: ParamSlot, key: str) -> torch.Tensor | None:
    """``slot``'s optimizer state ``key`` (``exp_avg``, ...), whole; a per-group scalar
    (``step``) as it is; None before the optimizer's first step."""
    tiles, states = engine.masters.group_state(slot.group, engine.optimizer)
    if not any(states):
        return None
    known = sorted({k for state in states for k in state})
    if key not in known:
        raise KeyError(
            f"optimizer state {key!r} does not exist for {slot.name}; "
            f"{type(engine.optimizer).__name__} keeps {', '.join(known)}"
        )
    first = states[0][key]
    if not isinstance(first, torch.Tensor) or first.numel() != tiles[0][0].numel():
        return first.clone() if isinstance(first, torch.Tensor) else first
    per_tile = [(state[key], where) for state, (_, where) in zip(states, tiles, strict=True)]
    return assemble(engine, slot, tile_reader(per_tile))


def full_gradient(engine: Engine, slot: ParamSlot) -> torch.Tensor | None:
    """``slot``'s gradient as the next step will apply it: summed over ranks and
    accumulated micro-steps, divided by ranks x accumulation steps x loss scale (float32,
    before clipping); None outside backward..step, where there is none."""
    if engine.micro_steps == 0:
        return None
    if engine.backward_stepper is not None:
        raise unsupported(
            "safe_get_full_grad with optimizer_in_backward",
            "each gradient is applied and dropped during backward",
        )
    denominator = float(engine.comm.world_size * engine.config.gradient_accumulation_steps)
    denominator *= engine.loss_scaler.scale
    gradients = engine.gradients
    if isinstance(gradients, AllReducedGradients):
        summed = gradients._reduced()[slot.group][slot.flat.start : slot.flat.stop]
        return (summed.float() / denominator).view(slot.shape)
    if not isinstance(gradients, ReduceScatteredGradients) or gradients.across_replicas:
        raise unsupported(
            f"safe_get_full_grad with {type(gradients).__name__}"
            + (
                " across replicas (hybrid sharding)"
                if isinstance(gradients, ReduceScatteredGradients)
                else ""
            ),
            "read the gradient after engine.step() applied it",
        )
    bucket = gradients.buckets.of(slot)
    away = None if gradients.tier is None else gradients.tier.homes.get(bucket.position)

    def read(local: Range) -> torch.Tensor:
        in_bucket = local.shift(bucket.local_offset)
        if away is not None:  # offloaded (offload_gradients): its host or disk copy
            return away.read(in_bucket.start, in_bucket.stop)
        if not has_storage(bucket.target):  # nothing reduced into it yet: zeros
            return torch.zeros(in_bucket.stop - in_bucket.start)
        return bucket.target[in_bucket.start : in_bucket.stop]

    return assemble(engine, slot, read) / denominator
