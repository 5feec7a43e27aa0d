"""Reading a sharded checkpoint folder: where it is, its index, and any range of the
elements of any parameter, from whichever shards hold them (see zero_core.checkpoint for
the layout). Used by the engine's load and by zero-consolidate alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .flat_layout import Range
from .safetensors_file import TensorFile, WrittenFile
from .sharded_state import ShardPiece

FORMAT = "zero-checkpoint"
VERSION = 1
INDEX = "index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine: missing, incomplete, corrupt,
    or saved from another model; the message names the file and what is wrong."""


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def complete_checkpoint(folder: Path) -> Path | None:
    """Where the complete checkpoint saved at ``folder`` is: ``folder`` itself if it has
    an index, else ``folder.old`` if a save was killed while swapping the two, else None."""
    if (folder / INDEX).exists():
        return folder
    old = folder.with_name(folder.name + ".old")
    if (old / INDEX).exists():
        return old
    return None


# A saved piece: (saving rank, first element, end element, offset in that rank's tensor).
SavedPiece = tuple[int, int, int, int]


class CheckpointReader:
    """One checkpoint: its index, and the pieces every saving rank wrote of each group."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        wanted = Path(path)
        found = complete_checkpoint(wanted)
        if found is None:
            staging = wanted.with_name(wanted.name + ".saving")
            hint = f" ({staging} is an unfinished save)" if staging.exists() else ""
            raise CheckpointError(
                f"no checkpoint at {wanted}: {wanted / INDEX} does not exist{hint}"
            )
        self.folder = found
        self.index = _read_index(found)
        self._files: dict[int, TensorFile] = {}
        self._saved: dict[int, dict[int, list[SavedPiece]]] = {}

    def file_of(self, rank: int) -> TensorFile:
        """Saving rank ``rank``'s shard, checked against the size and checksum the index
        recorded for it as it is read."""
        if rank not in self._files:
            expected = WrittenFile.from_json(self.index["ranks"][rank]["file"])
            self._files[rank] = TensorFile(self.folder / shard_name(rank), expected)
        return self._files[rank]

    def first_writer(self) -> int:
        """A rank that wrote sharded tensors (stage 0 checkpoints: rank 0 only)."""
        return next((r for r, e in enumerate(self.index["ranks"]) if e["pieces"] is not None), 0)

    def saved_pieces(self, group: int) -> dict[int, list[SavedPiece]]:
        """Parameter index in ``group`` -> every saved piece of it."""
        if group in self._saved:
            return self._saved[group]
        saved: dict[int, list[SavedPiece]] = self._saved.setdefault(group, {})
        for rank, entry in enumerate(self.index["ranks"]):
            if entry["pieces"] is None:
                continue
            for i, start, stop, offset in entry["pieces"][group]:
                saved.setdefault(i, []).append((rank, start, stop, offset))
        return saved

    def fill(self, target: torch.Tensor, needed: list[ShardPiece], group: int, name: str) -> None:
        """Copy into ``target`` (flat) each needed piece of ``group`` from the saved tensor
        ``name`` (``master.G`` or ``state.G.KEY``) of the ranks whose pieces overlap it."""
        saved = self.saved_pieces(group)
        for piece in needed:
            wanted = piece.elements
            covered = 0
            for rank, start, stop, at in saved.get(piece.param, []):
                lo, hi = max(start, wanted.start), min(stop, wanted.stop)
                if lo >= hi:
                    continue
                values = self.file_of(rank).read(name, at + lo - start, at + hi - start)
                target[piece.offset + lo - wanted.start : piece.offset + hi - wanted.start] = values
                covered += hi - lo
            if covered != wanted.size:
                raise CheckpointError(
                    f"{name}: parameter {piece.param} elements {wanted} are not all saved"
                )

    def read_whole(self, group: int, param: int, numel: int, name: str) -> torch.Tensor:
        """All ``numel`` elements of parameter ``param`` of ``group`` from tensor ``name``."""
        value = torch.empty(numel, device="cpu")  # a consolidated copy lives on the host
        self.fill(value, [ShardPiece(param, Range(0, numel), 0)], group, name)
        return value


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
