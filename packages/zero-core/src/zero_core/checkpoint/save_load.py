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
import warnings
from pathlib import Path
from typing import Any

import torch

from zero_comm.determinism import fingerprint_differences

from ..flat_layout import Range
from .reader import (
    FORMAT,
    INDEX,
    INDEX_CHECKSUM,
    VERSION,
    CheckpointError,
    CheckpointReader,
    complete_checkpoint,
    index_checksum,
    shard_name,
)
from .safetensors_file import CorruptFileError, write_file
from .sharded_state import Checkpointable, MasterPiece, ShardedGroupState, ShardedState

__all__ = ["CheckpointError", "DeterminismWarning", "load", "save"]


# ------------------------------------------------------------------------------ save
def save(
    engine: Checkpointable, path: str | os.PathLike[str], extra: dict[str, Any] | None
) -> None:
    """Collective: write ``engine``'s state to directory ``path`` (see the module doc)."""
    comm, final = engine.comm, Path(path)
    if engine.micro_steps:
        raise RuntimeError(
            f"[rank {comm.rank}] save() after {engine.micro_steps} backward calls without "
            "step(): save at an accumulation boundary, after step()"
        )
    state = engine.sharded_state()
    _scheduler_json(state.lr_scheduler)  # every rank alike, before anything is written
    staging = final.with_name(final.name + ".saving")
    if comm.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    comm.barrier()
    tensors: list[tuple[str, torch.Tensor]] = [("rng.cpu", torch.get_rng_state())]
    # Replicas of a shard group (hybrid sharding) hold the same slices: the first writes.
    first_replica = engine.shard_comm.rank == comm.rank
    writes_master = comm.rank == 0 or (not state.replicated and first_replica)
    if writes_master:
        for g, group in enumerate(state.groups):
            tensors.append((f"master.{g}", group.master()))
            for key, value in _sharded_states(group).items():
                tensors.append((f"state.{g}.{key}", value))
    if comm.rank == 0:
        tensors += [(f"whole.{name}", t) for name, t in engine.whole_tensors().items()]
    entry: dict[str, Any]
    try:
        written = write_file(staging / shard_name(comm.rank), tensors, {"format": FORMAT})
        entry = {
            "file": written.to_json(),
            "pieces": [_pieces_json(group) for group in state.groups] if writes_master else None,
            "fingerprint": engine.fingerprint().to_json(),
        }
    except OSError as exc:  # a full disk, a quota, a vanished mount: every rank must know
        entry = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = comm.all_gather_object(entry)
    failure = next((f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if "error" in e), "")
    if comm.rank == 0 and not failure:
        try:
            _write_index(staging, _index(engine, state, everyone, extra))
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
    _fsync_dir(staging)


def _swap_into_place(staging: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():  # else CKPT.old may be the only complete checkpoint: keep it
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _abandon(staging: Path, final: Path, failure: str, rank: int) -> None:
    """A save failed on some rank (``failure`` names it): every rank raises the same
    CheckpointError; rank 0 removes the partial copy. The previous checkpoint is untouched
    (the swap is the last step and each of its renames is atomic)."""
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    intact = complete_checkpoint(final)
    kept = f"the previous checkpoint {intact} is intact" if intact else "no earlier checkpoint"
    raise CheckpointError(
        f"[rank {rank}] saving checkpoint {final} failed on {failure}; the partial copy "
        f"{staging} was removed and {kept}. Free space (or point the save elsewhere) and "
        "save again"
    )


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pieces_json(group: ShardedGroupState) -> list[list[int]]:
    return [[p.param, p.elements.start, p.elements.stop, p.offset] for p in group.pieces]


def _sharded_states(group: ShardedGroupState) -> dict[str, torch.Tensor]:
    """Each optimizer state as large as its tile, concatenated over the group's tiles (so
    it lines up with the group's master)."""
    states = group.tile_states
    keys = [
        key
        for key, value in states[0].items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ] if states else []  # fmt: skip
    return {key: torch.cat([state[key].detach().reshape(-1) for state in states]) for key in keys}


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
    engine: Checkpointable, state: ShardedState, everyone: list[Any], extra: dict[str, Any] | None
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
        "world_size": engine.comm.world_size,
        "stage": engine.config.stage,
        "param_dtype": str(engine.dtype).removeprefix("torch."),
        "optimizer": state.optimizer,
        "groups": groups,
        "aliases": engine.tied_parameter_names(),
        "fingerprint": everyone[0]["fingerprint"],
        "deterministic_reductions": engine.comm.deterministic,
        "ranks": everyone,
        "engine": {
            "global_steps": state.global_steps,
            "skipped_steps": state.skipped_steps,
            "loss_scaler": state.loss_scaler,
            "lr_scheduler": _scheduler_json(state.lr_scheduler),
        },
        "extra": extra or {},
    }


# ------------------------------------------------------------------------------ load
def load(engine: Checkpointable, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: restore ``engine`` from the checkpoint at ``path``, whatever world size
    and stage saved it; returns the ``extra`` dict given to save. Each rank reads only the
    byte ranges of the pieces it holds, straight into the engine's master tiles."""
    reader = CheckpointReader(path)
    index, folder = reader.index, reader.folder
    if reader.headers_unchecked and engine.comm.rank == 0:
        warnings.warn(reader.headers_unchecked, stacklevel=3)
    state = engine.sharded_state()
    _check_compatible(state, index, folder)
    try:
        with torch.no_grad():
            for g, group in enumerate(state.groups):
                _fill_master(reader, group, g)
                group.tile_states = _tile_states(reader, group, g)
                group.options = _options(index["groups"][g]["options"], group.options)
            for name, tensor in engine.whole_tensors().items():
                tensor.copy_(reader.file_of(0).read(f"whole.{name}"))
        if index["world_size"] == engine.comm.world_size:
            torch.set_rng_state(reader.file_of(engine.comm.rank).read("rng.cpu"))
    except CorruptFileError as exc:
        raise CheckpointError(f"checkpoint {folder}: {exc}") from exc
    saved = index["engine"]
    state.global_steps = int(saved["global_steps"])
    state.skipped_steps = int(saved["skipped_steps"])
    state.loss_scaler = _loss_scaler_state(saved["loss_scaler"])
    state.lr_scheduler = saved.get("lr_scheduler")
    engine.load_sharded_state(state)
    _warn_on_other_fingerprint(engine, index, folder)
    return dict(index["extra"])


def _loss_scaler_state(saved: dict[str, Any]) -> dict[str, float | int]:
    """The loss scaler's state_dict() from an index. Checkpoints written before the
    scaler had one saved all its attributes; of those only a dynamic scale's progress is
    state (a bfloat16 run's fixed scale of 1 must not turn a float16 run's dynamic
    scaling off)."""
    if "_good_steps" not in saved:
        return dict(saved)
    if not saved.get("dynamic", False):
        return {}
    return {"scale": saved["scale"], "good_steps": saved["_good_steps"],
            "overflows_left": saved["_overflows_left"]}  # fmt: skip


class DeterminismWarning(UserWarning):
    """A checkpoint resumed under another fingerprint than it was saved with: the run goes
    on correctly, but not bit for bit as the uninterrupted run would have."""


def _warn_on_other_fingerprint(engine: Checkpointable, index: dict[str, Any], folder: Path) -> None:
    """Collective: rank 0 warns once, naming each difference of any rank's fingerprint from
    the one its state was saved under (the same rank's if the world size is unchanged)."""
    comm = engine.comm
    ranks = index["ranks"]
    saved = ranks[comm.rank] if len(ranks) == comm.world_size else ranks[0]
    mine = [
        f"saved with {d.what} {d.before}, resumed with {d.now}"
        for d in fingerprint_differences(saved.get("fingerprint", {}), engine.fingerprint())
    ]
    everyone = comm.all_gather_object(mine) if comm.world_size > 1 else [mine]
    if comm.rank != 0 or not any(everyone):
        return
    where = [r for r, found in enumerate(everyone) if found]
    ranks_text = "" if len(where) == comm.world_size else f" (on ranks {where})"
    named = "; ".join(sorted({line for found in everyone for line in found}))
    warnings.warn(
        f"checkpoint {folder}: {named}{ranks_text}: the continuation will not be bitwise "
        "identical to an uninterrupted run. Bits are reproducible only under an equal "
        "fingerprint; across fingerprints runs agree within the tolerance measured in "
        "packages/zero-core/README.md. Resume with the saved settings (zero-train "
        "--threads N) for a bitwise continuation.",
        DeterminismWarning,
        stacklevel=4,  # the caller of engine.load
    )


def _check_compatible(state: ShardedState, index: dict[str, Any], folder: Path) -> None:
    """Same parameters (names, shapes) in the same optimizer groups, same optimizer."""
    mine = [[[name, list(shape)] for name, shape in group.params] for group in state.groups]
    theirs = [group["params"] for group in index["groups"]]
    if len(mine) != len(theirs):
        raise CheckpointError(
            f"checkpoint {folder} has {len(theirs)} optimizer groups; this engine has "
            f"{len(mine)}: it was saved from another model or optimizer set-up"
        )
    for g, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a == b:
            continue
        for i in range(max(len(a), len(b))):
            here = a[i] if i < len(a) else None
            there = b[i] if i < len(b) else None
            if here != there:
                raise CheckpointError(
                    f"checkpoint {folder} is of another model: group {g} parameter {i} is "
                    f"{_describe(there)} there and {_describe(here)} here"
                )
    optimizer = state.optimizer
    if index["optimizer"] != optimizer:
        raise CheckpointError(
            f"checkpoint {folder} holds {index['optimizer']} states; this engine uses "
            f"{optimizer}: build the engine with {index['optimizer']} to resume"
        )


def _describe(entry: list[Any] | None) -> str:
    return "missing" if entry is None else f"{entry[0]} {tuple(entry[1])}"


def _fill_master(reader: CheckpointReader, group: ShardedGroupState, g: int) -> None:
    """Read this rank's master of group ``g`` straight into its tiles, in place: no second
    copy of the master. A piece that spans tiles (offloaded sub-groups cut within a
    bucket) is read in parts, one per tile."""
    for tile, where in group.master_tiles:
        start, stop = where.start or 0, where.stop
        inside = []
        for piece in group.pieces:
            a = max(start, piece.offset)
            b = min(stop, piece.offset + piece.elements.size)
            if a < b:
                first = piece.elements.start + a - piece.offset
                inside.append(MasterPiece(piece.param, Range(first, first + b - a), a - start))
        reader.fill(tile, inside, g, f"master.{g}")


def _tile_states(
    reader: CheckpointReader, group: ShardedGroupState, g: int
) -> list[dict[str, Any]]:
    """The optimizer state of each tile of group ``g``, on that tile's device: the saved
    tensors are read into one host buffer per state, and each tile gets its slice (a view
    for a host tile, a copy for a device tile). Scalar states (Adam's step) stay on the
    host, as torch's optimizers keep them, unless the group is ``fused`` or ``capturable``,
    where torch keeps them on the parameter's device."""
    prefix = f"state.{g}."
    first = reader.file_of(reader.first_writer())
    buffers = {}
    for name in first.names:
        if name.startswith(prefix):
            buffers[name[len(prefix) :]] = buffer = torch.zeros(
                group.numel, dtype=first.entry(name)[0], device="cpu"
            )
            reader.fill(buffer, group.pieces, g, name)
    scalars = {}
    for key, scalar in reader.index["groups"][g]["scalar_states"].items():
        value = scalar["value"]
        scalars[key] = (
            torch.tensor(value, dtype=getattr(torch, scalar["dtype"]), device="cpu")
            if "dtype" in scalar
            else value
        )
    scalars_on_device = bool(group.options.get("fused") or group.options.get("capturable"))
    states: list[dict[str, Any]] = []
    for tile, where in group.master_tiles:
        tile_state: dict[str, Any] = {
            key: buf[where].view_as(tile).to(tile.device) for key, buf in buffers.items()
        }
        # A scalar tensor per tile, as the optimizer keeps it (not one shared by all).
        tile_state.update(
            {
                k: v.to(tile.device if scalars_on_device else "cpu", copy=True)
                if isinstance(v, torch.Tensor) else v
                for k, v in scalars.items()
            }
        )  # fmt: skip
        states.append(tile_state if buffers or scalars else {})
    return states


def _options(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The saved hyper-parameters, as this optimizer keeps them (JSON gives lists for
    tuples such as Adam's betas)."""
    return {
        key: tuple(value) if isinstance(current.get(key), tuple) and isinstance(value, list)
        else value
        for key, value in saved.items()
    }  # fmt: skip
