"""Reading a sharded checkpoint folder: where it is, its index, and any range of the
elements of any parameter, from whichever shards hold them (see writer.py for
the layout). Used by the engine's load and by zero-consolidate alike.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..flat_layout import Range
from .format import (
    FORMAT,
    INDEX,
    INDEX_CHECKSUM,
    LATEST,
    VERSION,
    CheckpointError,
    index_checksum,
    read_latest,
    shard_name,
)
from .safetensors_file import CorruptFileError, TensorFile, WrittenFile
from .sharded_state import MasterPiece


def complete_checkpoint(folder: Path) -> Path | None:
    """Where the complete checkpoint saved at ``folder`` is. A folder of tags (tags.py):
    the one ``folder/latest`` names, and a CheckpointError if that one is not complete.
    Otherwise ``folder`` itself if it has an index, else ``folder.old`` if a save was killed
    while swapping the two, else None."""
    tag = read_latest(folder)
    if tag is not None:
        found = complete_checkpoint(folder / tag)
        if found is None:
            raise CheckpointError(
                f"{folder / LATEST} names checkpoint {tag}, but {folder / tag} holds no "
                f"complete checkpoint: load another tag (load(..., tag=...)) or restore it"
            )
        return found
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

    @property
    def headers_unchecked(self) -> str:
        """A note when the index predates its shards' header checksums ("" otherwise):
        such a checkpoint's headers are read without a check."""
        if all("header_crc32" in entry["file"] for entry in self.index["ranks"]):
            return ""
        return (
            f"checkpoint {self.folder} was saved before its files' headers were checksummed: "
            "they are read unchecked (a save now records them)"
        )

    def check_files(self) -> None:
        """Every saving rank's shard is there, of the size the index records, with a
        readable header and a checksum per block: what can be checked without reading a
        value (a launcher does it before starting ranks). Raises CheckpointError."""
        for rank in range(len(self.index["ranks"])):
            try:
                self.file_of(rank)
            except CorruptFileError as exc:
                raise CheckpointError(f"checkpoint {self.folder}: {exc}") from None

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

    def fill(self, target: torch.Tensor, needed: list[MasterPiece], group: int, name: str) -> None:
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
        self.fill(value, [MasterPiece(param, Range(0, numel), 0)], group, name)
        return value


def _read_index(folder: Path) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads((folder / INDEX).read_text())
    except ValueError as exc:
        raise CheckpointError(f"{folder / INDEX}: not valid JSON ({exc})") from exc
    if not isinstance(index, dict):
        raise CheckpointError(f"{folder / INDEX}: {index_shape_problem(index)}")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(
            f"{folder / INDEX}: format {index.get('format')!r} version {index.get('version')!r}"
            f" is not {FORMAT!r} version {VERSION}"
        )
    recorded = index.pop(INDEX_CHECKSUM, None)
    if recorded is not None and recorded != index_checksum(index):
        raise CheckpointError(
            f"{folder / INDEX}: its checksum does not match its contents (changed after the "
            "save, by an edit or by damage): restore it from a copy, or use another checkpoint"
        )
    problem = index_shape_problem(index)
    if problem:
        raise CheckpointError(
            f"{folder / INDEX}: {problem}; the index is damaged (or was edited): restore it "
            "from a copy, or use another checkpoint"
        )
    return index


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_lists(value: Any, length: int | None = None) -> bool:
    """Whether ``value`` is a list of lists of ints (each of ``length``, when given)."""
    return isinstance(value, list) and all(
        isinstance(item, list) and all(_is_int(x) for x in item)
        and (length is None or len(item) == length)
        for item in value
    )  # fmt: skip


def index_shape_problem(index: Any) -> str:
    """What is missing or of the wrong type in a checkpoint index ("" if nothing): the
    keys every reader uses, checked before any of them is read, so a damaged index is
    one error naming the key, not a KeyError from deep inside a load."""
    if not isinstance(index, dict):
        return f"holds a JSON {type(index).__name__}, not an object"
    groups, ranks = index.get("groups"), index.get("ranks")
    if not isinstance(groups, list) or not groups:
        return "'groups' is missing or empty"
    for g, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not params or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _int_lists([p[1]])
            for p in params
        ):  # fmt: skip
            return f"groups[{g}]['params'] is not a list of [name, shape]"
    if not isinstance(ranks, list) or not ranks:
        return "'ranks' is missing or empty"
    for r, entry in enumerate(ranks):
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, dict) or not all(
            _is_int(file.get(k)) for k in ("bytes", "block_bytes")
        ):
            return f"ranks[{r}]['file'] lacks its size"
        crcs = file.get("crc32")
        if not isinstance(crcs, list) or not all(_is_int(c) for c in crcs):
            return f"ranks[{r}]['file']['crc32'] is not a list of checksums"
        if "header_crc32" in file and not _is_int(file["header_crc32"]):
            return f"ranks[{r}]['file']['header_crc32'] is not a checksum"
        pieces = entry.get("pieces", ...)
        if pieces is ... or (pieces is not None and (
            not isinstance(pieces, list) or len(pieces) != len(groups)
            or not all(_int_lists(group, 4) for group in pieces)
        )):  # fmt: skip
            return f"ranks[{r}]['pieces'] is not one list of pieces per group"
    weights = index.get("shard_weights")
    if weights is not None and (
        not isinstance(weights, list)
        or len(weights) != len(ranks)
        or not all(isinstance(w, int | float) and w > 0 for w in weights)
    ):
        return f"'shard_weights' is not one positive weight per saving rank ({len(ranks)})"
    uncovered = _uncovered_parameter(groups, ranks)
    if uncovered:
        return uncovered
    aliases = index.get("aliases", {})
    names = {p[0] for group in groups for p in group["params"]}
    if not isinstance(aliases, dict) or not all(
        isinstance(name, str) and name in names for name in aliases.values()
    ):
        return "'aliases' is not an object of names to saved parameters' names"
    return ""


def _uncovered_parameter(groups: list[Any], ranks: list[Any]) -> str:
    """A parameter whose saved pieces, over every rank, do not cover exactly its elements
    per its recorded shape ("" if none): a shape edited in the index would read a part of
    a tensor, or past it."""
    for g, group in enumerate(groups):
        spans: dict[int, list[tuple[int, int]]] = {}
        for entry in ranks:
            for i, start, stop, _ in entry["pieces"][g] if entry["pieces"] is not None else ():
                spans.setdefault(i, []).append((start, stop))
        for i, (name, shape) in enumerate(group["params"]):
            reached = 0
            for start, stop in sorted(spans.get(i, [])):
                if start > reached:
                    break
                reached = max(reached, stop)
            if reached != math.prod(shape) or any(s < 0 for s, _ in spans.get(i, [])):
                return (
                    f"groups[{g}] parameter {name!r} of shape {shape} is not covered exactly "
                    "by its saved pieces"
                )
    return ""
