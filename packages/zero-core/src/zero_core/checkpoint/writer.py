"""Sharded checkpoints: each rank writes its shard, any world size and stage reads them.

    CKPT/
      index.json                 layout, optimizer scalars, loss scaler, steps, checksums
      rank-00000.safetensors     master.G, state.G.KEY (this rank's part of group G);
      rank-00001.safetensors     rng.cpu; rank 0 also whole.NAME (frozen params, buffers)

Every sharded tensor of group G on rank r (its float32 master and each optimizer state of
the same size) holds the same *pieces*, listed in the index as

    [parameter index in G, first element, end element, offset in the rank's tensor]

so a loader with another world size or stage works out, for each piece it needs, which
saved ranks hold it and reads just those byte ranges (safetensors_file). Stage 0 ranks
all hold the same state, so only rank 0 writes a shard.

Atomic: shards and index go to ``CKPT.saving/`` (each file through a temporary name and
fsync), and only then is the directory renamed into place (an existing ``CKPT`` is moved to
``CKPT.old`` first and deleted after). A process killed at any moment leaves either the
previous checkpoint at ``CKPT`` or, inside the rename window, at ``CKPT.old``, which
:func:`load` falls back to.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from zero_comm import Communicator
from zero_comm.profiler_ranges import profiler_range

from .format import (
    FORMAT,
    INDEX,
    INDEX_CHECKSUM,
    VERSION,
    CheckpointError,
    index_checksum,
    read_latest,
    shard_name,
)
from .reader import complete_checkpoint
from .safetensors_file import Value, write_stream
from .sharded_state import ShardedGroupState, ShardedState

__all__ = ["save"]


def save(
    state: ShardedState,
    comm: Communicator,
    path: str | os.PathLike[str],
    extra: dict[str, Any] | None = None,
) -> None:
    """Collective over ``comm`` (the data-parallel world): write every rank's ``state`` to
    directory ``path`` (see the module doc). ``state`` is all it reads: this module never
    calls into an engine."""
    with profiler_range("checkpoint.save"):
        _save(state, comm, Path(path), extra)


def _save(
    state: ShardedState, comm: Communicator, final: Path, extra: dict[str, Any] | None
) -> None:
    _scheduler_json(state.lr_scheduler)  # every rank alike, before anything is written
    staging = final.with_name(final.name + ".saving")
    if comm.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    comm.barrier()
    # Replicas of a shard group (hybrid sharding) hold the same slices: the first writes.
    writes_master = comm.rank == 0 or (not state.replicated and state.first_replica)
    specs, values = _rank_file(state, writes_master, comm.rank == 0)
    entry: dict[str, Any]
    try:
        written = write_stream(staging / shard_name(comm.rank), specs, values, {"format": FORMAT})
        entry = {
            "file": written.to_json(),
            "pieces": [_pieces_json(group) for group in state.groups] if writes_master else None,
            "fingerprint": state.fingerprint.to_json(),
        }
    except OSError as exc:  # a full disk, a quota, a vanished mount: every rank must know
        entry = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = comm.all_gather_object(entry)
    failure = next((f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if "error" in e), "")
    if comm.rank == 0 and not failure:
        try:
            _write_index(staging, _index(state, comm, everyone, extra))
            _swap_into_place(staging, final)
        except OSError as exc:
            failure = f"rank 0: {type(exc).__name__}: {exc}"
    failure = comm.all_gather_object(failure)[0] or failure
    if failure:
        _abandon(staging, final, failure, comm.rank)
    comm.barrier()


def _write_index(staging: Path, index: dict[str, Any]) -> None:
    text = json.dumps({**index, INDEX_CHECKSUM: index_checksum(index)}, indent=1).encode()
    partial = staging / (INDEX + ".partial")
    with partial.open("wb") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, staging / INDEX)
    fsync_dir(staging)


def _swap_into_place(staging: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():  # else CKPT.old may be the only complete checkpoint: keep it
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _abandon(staging: Path, final: Path, failure: str, rank: int) -> None:
    """A save failed on some rank (``failure`` names it): every rank raises the same
    CheckpointError; rank 0 removes the partial copy. The previous checkpoint is untouched
    (the swap is the last step and each of its renames is atomic)."""
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    intact = complete_checkpoint(final) or _latest_in(final.parent)
    kept = f"the previous checkpoint {intact} is intact" if intact else "no earlier checkpoint"
    raise CheckpointError(
        f"[rank {rank}] saving checkpoint {final} failed on {failure}; the partial copy "
        f"{staging} was removed and {kept}. Free space (or point the save elsewhere) and "
        "save again"
    )


def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pieces_json(group: ShardedGroupState) -> list[list[int]]:
    return [[p.param, p.elements.start, p.elements.stop, p.offset] for p in group.pieces]


def _rank_file(
    state: ShardedState, writes_master: bool, writes_whole: bool
) -> tuple[list[tuple[str, torch.dtype, list[int]]], list[Value]]:
    """This rank's file, as write_stream's specs and values: rng.cpu; master.G and
    state.G.KEY of every group (``writes_master``), each written tile by tile in the
    group's order, never joined into one tensor (a save then holds no copy of the shard:
    joining the tiles cost one copy of every state, on the device where the states live);
    whole.NAME (``writes_whole``)."""
    rng = torch.get_rng_state()
    specs: list[tuple[str, torch.dtype, list[int]]] = [("rng.cpu", rng.dtype, list(rng.shape))]
    values: list[Value] = [rng]

    def add(name: str, chunks: list[torch.Tensor], dtype: torch.dtype) -> None:
        specs.append((name, dtype, [sum(c.numel() for c in chunks)]))
        values.append(chunks)

    if writes_master:
        for g, group in enumerate(state.groups):
            tiles = [tile.detach().reshape(-1) for tile, _ in group.master_tiles]
            add(f"master.{g}", tiles, tiles[0].dtype if tiles else torch.float32)
            for key, chunks in _sharded_states(group).items():
                add(f"state.{g}.{key}", chunks, chunks[0].dtype)
    if writes_whole:
        for name, tensor in state.whole.items():
            specs.append((f"whole.{name}", tensor.dtype, list(tensor.shape)))
            values.append(tensor)
    return specs, values


def _sharded_states(group: ShardedGroupState) -> dict[str, list[torch.Tensor]]:
    """Each optimizer state as large as its tile, as its tiles' flat pieces in the group's
    order (so, written one after the other, it lines up with the group's master)."""
    states = group.tile_states
    keys = [
        key
        for key, value in states[0].items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ] if states else []  # fmt: skip
    return {key: [state[key].detach().reshape(-1) for state in states] for key in keys}


def _scalar_states(group: ShardedGroupState, g: int) -> dict[str, Any]:
    """Optimizer states that are numbers or 0-d tensors (Adam's step): equal on every
    tile of the group, saved once."""
    out: dict[str, Any] = {}
    for tile_state in group.tile_states:
        for key, value in tile_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                continue
            if isinstance(value, torch.Tensor):
                entry = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                entry = {"value": value}
            if out.setdefault(key, entry) != entry:
                raise RuntimeError(f"optimizer state {key!r} differs within group {g}")
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        items = [_json_safe(v) for v in value]
        return None if any(i is _UNSAFE for i in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        entries = {k: _json_safe(v) for k, v in value.items()}
        return _UNSAFE if any(v is _UNSAFE for v in entries.values()) else entries
    return _UNSAFE


def _scheduler_json(state: dict[str, Any] | None) -> Any:
    value = _json_safe(state)
    if value is _UNSAFE:
        raise CheckpointError(
            f"the learning-rate scheduler's state_dict() {state!r} is not JSON data, so a "
            "checkpoint cannot keep it: give the scheduler a state_dict of numbers and lists"
        )
    return value


_UNSAFE = object()


def _index(
    state: ShardedState, comm: Communicator, everyone: list[Any], extra: dict[str, Any] | None
) -> dict[str, Any]:
    groups = []
    for g, group in enumerate(state.groups):
        options = {
            key: _json_safe(value)
            for key, value in group.options.items()
            if _json_safe(value) is not _UNSAFE
        }
        groups.append(
            {
                "params": [[name, list(shape)] for name, shape in group.params],
                "options": options,
                "scalar_states": _scalar_states(group, g),
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": comm.world_size,
        "shard_weights": None if state.shard_weights is None else list(state.shard_weights),
        "stage": state.stage,
        "param_dtype": str(state.param_dtype).removeprefix("torch."),
        "optimizer": state.optimizer,
        "groups": groups,
        "aliases": state.aliases,
        "fingerprint": everyone[0]["fingerprint"],
        "deterministic_reductions": comm.deterministic,
        "ranks": everyone,
        "engine": {
            "global_steps": state.global_steps,
            "skipped_steps": state.skipped_steps,
            "loss_scaler": state.loss_scaler,
            "lr_scheduler": _scheduler_json(state.lr_scheduler),
        },
        "extra": extra or {},
    }


def _latest_in(folder: Path) -> Path | None:
    """The checkpoint ``folder/latest`` names (a folder of tags), if it is complete."""
    try:
        return complete_checkpoint(folder) if read_latest(folder) is not None else None
    except CheckpointError:
        return None
