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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zero_comm.determinism import fingerprint_differences

from .flat_layout import Range
from .safetensors_file import CorruptFileError, TensorFile, WrittenFile, write_file

if TYPE_CHECKING:
    from .engine import ZeroEngine

FORMAT = "zero-checkpoint"
VERSION = 1
INDEX = "index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine: missing, incomplete, corrupt,
    or saved from another model; the message names the file and what is wrong."""


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# ------------------------------------------------------------------------------ save
def save(engine: ZeroEngine, path: str | os.PathLike[str], extra: dict[str, Any] | None) -> None:
    """Collective: write ``engine``'s state to directory ``path`` (see the module doc)."""
    comm, final = engine.comm, Path(path)
    if engine.micro_steps:
        raise RuntimeError(
            f"[rank {comm.rank}] save() after {engine.micro_steps} backward calls without "
            "step(): save at an accumulation boundary, after step()"
        )
    staging = final.with_name(final.name + ".saving")
    if comm.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    comm.barrier()
    tensors: list[tuple[str, torch.Tensor]] = [("rng.cpu", torch.get_rng_state())]
    writes_master = comm.rank == 0 or not engine._replicated_master
    groups = range(len(engine.master_pieces))
    if writes_master:
        for g in groups:
            tensors.append((f"master.{g}", engine._master_values(g)))
            for key, value in _sharded_states(engine, g).items():
                tensors.append((f"state.{g}.{key}", value))
    if comm.rank == 0:
        tensors += [(f"whole.{name}", t) for name, t in engine.whole_tensors().items()]
    entry: dict[str, Any]
    try:
        written = write_file(staging / shard_name(comm.rank), tensors, {"format": FORMAT})
        entry = {
            "file": written.to_json(),
            "pieces": [_pieces_json(engine, g) for g in groups] if writes_master else None,
            "fingerprint": engine.fingerprint().to_json(),
        }
    except OSError as exc:  # a full disk, a quota, a vanished mount: every rank must know
        entry = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = comm.all_gather_object(entry)
    failure = next((f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if "error" in e), "")
    if comm.rank == 0 and not failure:
        try:
            _write_index(staging, _index(engine, everyone, extra))
            _swap_into_place(staging, final)
        except OSError as exc:
            failure = f"rank 0: {type(exc).__name__}: {exc}"
    failure = comm.all_gather_object(failure)[0] or failure
    if failure:
        _abandon(staging, final, failure, comm.rank)
    comm.barrier()


def _write_index(staging: Path, index: dict[str, Any]) -> None:
    text = json.dumps(index, indent=1).encode()
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
    intact = next(
        (str(c) for c in (final, final.with_name(final.name + ".old")) if (c / INDEX).exists()),
        None,
    )
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


def _param_names(engine: ZeroEngine) -> dict[int, str]:
    return {id(p): name for name, p in engine.module.named_parameters()}


def _pieces_json(engine: ZeroEngine, group: int) -> list[list[int]]:
    return [[i, r.start, r.stop, offset] for i, r, offset in engine._shard_pieces(group)]


def _sharded_states(engine: ZeroEngine, group: int) -> dict[str, torch.Tensor]:
    """Each optimizer state as large as its tensor, concatenated over the group's pieces
    (so it lines up with the group's master)."""
    pieces = engine.master_pieces[group]
    states = [engine.optimizer.state.get(piece, {}) for piece, _ in pieces]
    keys = [
        key
        for key, value in states[0].items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ] if states else []  # fmt: skip
    return {key: torch.cat([state[key].detach().reshape(-1) for state in states]) for key in keys}


def _scalar_states(engine: ZeroEngine, group: int) -> dict[str, Any]:
    """Optimizer states that are numbers or 0-d tensors (Adam's step): equal on every
    piece of the group, saved once."""
    out: dict[str, Any] = {}
    for piece, _ in engine.master_pieces[group]:
        for key, value in engine.optimizer.state.get(piece, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                continue
            if isinstance(value, torch.Tensor):
                entry = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                entry = {"value": value}
            if out.setdefault(key, entry) != entry:
                raise RuntimeError(f"optimizer state {key!r} differs within group {group}")
    return out


def _aliases(engine: ZeroEngine) -> dict[str, str]:
    """Second names of tied parameters -> the first (state_dict lists both)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _json_safe(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        items = [_json_safe(v) for v in value]
        return None if any(i is _UNSAFE for i in items) else items
    return _UNSAFE


_UNSAFE = object()


def _index(engine: ZeroEngine, everyone: list[Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    names = _param_names(engine)
    groups = []
    for g, params in enumerate(engine.groups.params):
        options = {
            key: _json_safe(value)
            for key, value in engine.optimizer.param_groups[g].items()
            if key != "params" and _json_safe(value) is not _UNSAFE
        }
        groups.append(
            {
                "params": [[names[id(p)], list(p.shape)] for p in params],
                "options": options,
                "scalar_states": _scalar_states(engine, g),
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": engine.comm.world_size,
        "stage": engine.config.stage,
        "param_dtype": str(engine.dtype).removeprefix("torch."),
        "optimizer": type(engine.optimizer).__name__,
        "groups": groups,
        "aliases": _aliases(engine),
        "fingerprint": everyone[0]["fingerprint"],
        "deterministic_reductions": engine.comm.deterministic,
        "ranks": everyone,
        "engine": {
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "loss_scaler": dict(vars(engine.loss_scaler)),
        },
        "extra": extra or {},
    }


# ------------------------------------------------------------------------------ load
def load(engine: ZeroEngine, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: restore ``engine`` from the checkpoint at ``path``, whatever world size
    and stage saved it; returns the ``extra`` dict given to save. Each rank reads only the
    byte ranges of the pieces it holds."""
    folder = _complete_checkpoint(Path(path))
    index = _read_index(folder)
    _check_compatible(engine, index, folder)
    files: dict[int, TensorFile] = {}

    def file_of(rank: int) -> TensorFile:
        if rank not in files:
            expected = WrittenFile.from_json(index["ranks"][rank]["file"])
            files[rank] = TensorFile(folder / shard_name(rank), expected)
        return files[rank]

    try:
        for g in range(len(engine.master_pieces)):
            saved = _saved_pieces(index, g)
            _fill_master(engine, g, saved, file_of)
            _load_optimizer_group(engine, index, g, saved, file_of)
        whole = engine.whole_tensors()
        for name, tensor in whole.items():
            value = file_of(0).read(f"whole.{name}")
            with torch.no_grad():
                tensor.copy_(value)
        if index["world_size"] == engine.comm.world_size:
            torch.set_rng_state(file_of(engine.comm.rank).read("rng.cpu"))
    except CorruptFileError as exc:
        raise CheckpointError(f"checkpoint {folder}: {exc}") from exc
    state = index["engine"]
    engine.global_steps = int(state["global_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    for key, value in state["loss_scaler"].items():
        setattr(engine.loss_scaler, key, value)
    engine.zero_grad()
    engine._publish_parameters()
    _warn_on_other_fingerprint(engine, index, folder)
    return dict(index["extra"])


class DeterminismWarning(UserWarning):
    """A checkpoint resumed under another fingerprint than it was saved with: the run goes
    on correctly, but not bit for bit as the uninterrupted run would have."""


def _warn_on_other_fingerprint(engine: ZeroEngine, index: dict[str, Any], folder: Path) -> None:
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


def _complete_checkpoint(folder: Path) -> Path:
    """``folder`` if it holds an index; ``folder.old`` if a save was killed while
    swapping the two; else a CheckpointError saying what is there."""
    if (folder / INDEX).exists():
        return folder
    old = folder.with_name(folder.name + ".old")
    if (old / INDEX).exists():
        return old
    staging = folder.with_name(folder.name + ".saving")
    hint = f" ({staging} is an unfinished save)" if staging.exists() else ""
    raise CheckpointError(f"no checkpoint at {folder}: {folder / INDEX} does not exist{hint}")


def _read_index(folder: Path) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads((folder / INDEX).read_text())
    except ValueError as exc:
        raise CheckpointError(f"{folder / INDEX}: not valid JSON ({exc})") from exc
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(
            f"{folder / INDEX}: format {index.get('format')!r} version {index.get('version')!r}"
            f" is not {FORMAT!r} version {VERSION}"
        )
    return index


def _check_compatible(engine: ZeroEngine, index: dict[str, Any], folder: Path) -> None:
    """Same parameters (names, shapes) in the same optimizer groups, same optimizer."""
    names = _param_names(engine)
    mine = [[[names[id(p)], list(p.shape)] for p in params] for params in engine.groups.params]
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
    optimizer = type(engine.optimizer).__name__
    if index["optimizer"] != optimizer:
        raise CheckpointError(
            f"checkpoint {folder} holds {index['optimizer']} states; this engine uses "
            f"{optimizer}: build the engine with {index['optimizer']} to resume"
        )


def _describe(entry: list[Any] | None) -> str:
    return "missing" if entry is None else f"{entry[0]} {tuple(entry[1])}"


Saved = dict[int, list[tuple[int, int, int, int]]]  # param -> (rank, start, stop, offset)


def _saved_pieces(index: dict[str, Any], group: int) -> Saved:
    saved: Saved = {}
    for rank, entry in enumerate(index["ranks"]):
        if entry["pieces"] is None:
            continue
        for i, start, stop, offset in entry["pieces"][group]:
            saved.setdefault(i, []).append((rank, start, stop, offset))
    return saved


def _fill(
    target: torch.Tensor,
    needed: list[tuple[int, Range, int]],
    saved: Saved,
    file_of: Callable[[int], TensorFile],
    name: str,
) -> None:
    """Copy into ``target`` (flat) each needed piece (param, range, offset in target)
    from the saved pieces that overlap it."""
    for i, wanted, offset in needed:
        covered = 0
        for rank, start, stop, at in saved.get(i, []):
            lo, hi = max(start, wanted.start), min(stop, wanted.stop)
            if lo >= hi:
                continue
            values = file_of(rank).read(name, at + lo - start, at + hi - start)
            target[offset + lo - wanted.start : offset + hi - wanted.start] = values
            covered += hi - lo
        if covered != wanted.size:
            raise CheckpointError(f"{name}: parameter {i} elements {wanted} are not all saved")


def _fill_master(
    engine: ZeroEngine, group: int, saved: Saved, file_of: Callable[[int], TensorFile]
) -> None:
    """Read this rank's master of ``group`` straight into the pieces the optimizer steps
    (each parameter piece lies within one of them): in place, whether the master is one
    tensor or, with float32 parameters at stages 1 and 2, slices of the parameters."""
    needed = engine._shard_pieces(group)
    with torch.no_grad():
        for piece, where in engine.master_pieces[group]:
            start, stop = where.start or 0, where.stop
            inside = [(i, r, offset - start) for i, r, offset in needed if start <= offset < stop]
            _fill(piece.detach().view(-1), inside, saved, file_of, f"master.{group}")


def _load_optimizer_group(
    engine: ZeroEngine, index: dict[str, Any], group: int, saved: Saved,
    file_of: Callable[[int], TensorFile],
) -> None:  # fmt: skip
    """Rebuild the optimizer state of every piece of ``group`` from the saved shards."""
    entry = index["groups"][group]
    first = next((r for r, e in enumerate(index["ranks"]) if e["pieces"] is not None), 0)
    prefix = f"state.{group}."
    keys = [n[len(prefix) :] for n in file_of(first).names if n.startswith(prefix)]
    numel = sum(piece.numel() for piece, _ in engine.master_pieces[group])
    buffers = {}
    for key in keys:
        buffers[key] = torch.zeros(numel, dtype=file_of(first).entry(prefix + key)[0])
        _fill(buffers[key], engine._shard_pieces(group), saved, file_of, prefix + key)
    scalars = entry["scalar_states"]
    for piece, where in engine.master_pieces[group]:
        state: dict[str, Any] = {key: buf[where].view_as(piece) for key, buf in buffers.items()}
        for key, scalar in scalars.items():
            value = scalar["value"]
            if "dtype" in scalar:
                value = torch.tensor(value, dtype=getattr(torch, scalar["dtype"]))
            state[key] = value
        if state:
            engine.optimizer.state[piece] = state
    for key, value in entry["options"].items():
        current = engine.optimizer.param_groups[group].get(key)
        engine.optimizer.param_groups[group][key] = (
            tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
        )
