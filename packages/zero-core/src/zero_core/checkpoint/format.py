"""What a checkpoint folder is named and marked with, shared by its writer and its readers.

    CKPT/index.json               INDEX, carrying FORMAT, VERSION and INDEX_CHECKSUM
    CKPT/rank-00000.safetensors   shard_name(0), one per saving rank
    DIR/latest                    LATEST: the tag (CKPT = DIR/<tag>) saved last

The index's checksum is index_checksum over everything else in it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

FORMAT = "zero-checkpoint"
VERSION = 1
INDEX_CHECKSUM = "index_crc32"  # the index's own checksum (index_checksum), since 2026-12
INDEX = "index.json"
LATEST = "latest"  # DIR/latest: the tag of the last checkpoint saved into DIR (tags.py)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine: missing, incomplete, corrupt,
    or saved from another model; the message names the file and what is wrong."""


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def index_checksum(index: dict[str, Any]) -> int:
    """CRC-32 of the index's contents (without its own checksum), key order aside: the
    index tells a reader where every tensor is and what shape it has, so an edit to it
    could otherwise load wrong values without an error. Indexes written before it was
    recorded are read without it, checked for their shape only."""
    return zlib.crc32(json.dumps(index, sort_keys=True, separators=(",", ":")).encode())


def read_latest(folder: Path) -> str | None:
    """The tag ``folder/latest`` names, or None where there is no such file."""
    try:
        tag = (folder / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    except (NotADirectoryError, IsADirectoryError):
        return None
    if not tag or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(
            f"{folder / LATEST} names {tag!r}, which is not a checkpoint tag of {folder}: "
            "write the tag of a checkpoint folder there, or load with tag=..."
        )
    return tag
