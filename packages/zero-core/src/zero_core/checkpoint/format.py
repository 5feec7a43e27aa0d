"""What a checkpoint folder is named and marked with, shared by its writer and its readers.

    CKPT/index.json               INDEX, carrying FORMAT, VERSION and INDEX_CHECKSUM
    CKPT/rank-00000.safetensors   shard_name(0), one per saving rank

The index's checksum is index_checksum over everything else in it.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

FORMAT = "zero-checkpoint"
VERSION = 1
INDEX_CHECKSUM = "index_crc32"  # the index's own checksum (index_checksum), since 2026-12
INDEX = "index.json"


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
