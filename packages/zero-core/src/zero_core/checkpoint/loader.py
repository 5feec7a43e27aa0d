"""Loading a sharded checkpoint into a ShardedState, whatever world size and stage saved it.

The caller hands over this rank's state as plain data (``Engine.sharded_state()``: views of
its master tiles and of the tensors every rank holds whole) and gets it back filled in
place: master tiles read straight from the byte ranges of the saved pieces they need,
optimizer states and scalars set on the state. Applying it (``Engine.load_sharded_state``)
is the caller's business: this module never calls into an engine. The layout is
writer.py's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from zero_comm import Communicator
from zero_comm.determinism import fingerprint_differences
from zero_comm.profiler_ranges import profiler_range

from ..flat_layout import Range
from .format import CheckpointError
from .reader import CheckpointReader
from .safetensors_file import CorruptFileError
from .sharded_state import MasterPiece, ShardedGroupState, ShardedState

__all__ = ["DeterminismWarning", "load"]


def load(state: ShardedState, comm: Communicator, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Collective: fill ``state`` (this rank's, as ``Engine.sharded_state()`` gives it) from
    the checkpoint at ``path`` in place; returns the ``extra`` dict given to save. Each rank
    reads only the byte ranges of the pieces it holds, straight into its master tiles; the
    tensors held whole are copied into ``state.whole``'s. The caller then applies ``state``
    (``Engine.load_sharded_state``)."""
    with profiler_range("checkpoint.load"):
        return _load(state, comm, path)


def _load(state: ShardedState, comm: Communicator, path: str | os.PathLike[str]) -> dict[str, Any]:
    reader = CheckpointReader(path)
    index, folder = reader.index, reader.folder
    if reader.headers_unchecked and comm.rank == 0:
        warnings.warn(reader.headers_unchecked, stacklevel=4)
    _check_compatible(state, index, folder)
    try:
        with torch.no_grad():
            for g, group in enumerate(state.groups):
                _fill_master(reader, group, g)
                group.tile_states = _tile_states(reader, group, g)
                group.options = _options(index["groups"][g]["options"], group.options)
            for name, tensor in state.whole.items():
                tensor.copy_(reader.file_of(0).read(f"whole.{name}"))
        if index["world_size"] == comm.world_size:
            torch.set_rng_state(reader.file_of(comm.rank).read("rng.cpu"))
    except CorruptFileError as exc:
        raise CheckpointError(f"checkpoint {folder}: {exc}") from exc
    saved = index["engine"]
    state.global_steps = int(saved["global_steps"])
    state.skipped_steps = int(saved["skipped_steps"])
    state.loss_scaler = _loss_scaler_state(saved["loss_scaler"])
    state.lr_scheduler = saved.get("lr_scheduler")
    _warn_on_other_fingerprint(state, comm, index, folder)
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


def _warn_on_other_fingerprint(
    state: ShardedState, comm: Communicator, index: dict[str, Any], folder: Path
) -> None:
    """Collective: rank 0 warns once, naming each difference of any rank's fingerprint from
    the one its state was saved under (the same rank's if the world size is unchanged)."""
    ranks = index["ranks"]
    saved = ranks[comm.rank] if len(ranks) == comm.world_size else ranks[0]
    mine = [
        f"saved with {d.what} {d.before}, resumed with {d.now}"
        for d in fingerprint_differences(saved.get("fingerprint", {}), state.fingerprint)
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
        stacklevel=5,  # the caller of engine.load
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
