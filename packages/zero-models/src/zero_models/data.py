"""Training data: a token stream, and each data-parallel rank's part of every global batch.

Sources (``load_tokens``):
    None              the default corpus: the Python standard library's source, as bytes
    a .bin/.u16 file  pre-tokenised uint16 tokens
    any other file    its bytes (vocabulary 256)
    a folder          the bytes of its files, sorted by path

A global batch of ``global_batch`` sequences is drawn at offsets that depend only on
(seed, step); data-parallel rank r of D takes rows [r*B/D, (r+1)*B/D):

    global batch (B = 4, D = 2):  row 0 | row 1 | row 2 | row 3
                                  rank 0        | rank 1

so ranks read disjoint parts, and the run does not depend on how it was launched.

With micro-batch slots per rank (``counts``, zero-train's --micro-batches-per-rank), the
global batch is split over the V = sum(counts) virtual ranks instead, and rank i's slot s
takes virtual rank o_i + s's rows (o_i = counts[0] + ... + counts[i-1]), exactly the rows
that rank of a homogeneous run at V ranks reads:

    counts (2, 1), B = 6:  rows 0-1 | rows 2-3 | rows 4-5
                           rank 0 slot 0 | rank 0 slot 1 | rank 1 slot 0
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from .corpus import default_corpus_bytes

UINT16_SUFFIXES = (".bin", ".u16")


def token_count(source: str | Path | None, *, max_bytes: int = 16 << 20) -> int:
    """How many tokens ``load_tokens(source)`` gives, from the files' sizes alone, so that
    a launcher can refuse missing, empty or malformed data before any rank starts. Raises
    FileNotFoundError or ValueError naming the source and the fix."""
    if source is None:
        return int(default_corpus_bytes(max_bytes).numel())
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--data {source}: no such file or folder")
    if path.is_dir():
        files = _folder_files(path)
        if not files:
            raise FileNotFoundError(f"--data {source}: the folder has no files")
        size = min(max_bytes, sum(p.stat().st_size for p in files))
    elif path.suffix in UINT16_SUFFIXES:
        size = path.stat().st_size
        if not size:
            raise ValueError(f"--data {source}: empty; give a file of uint16 tokens")
        if size % 2:
            raise ValueError(f"--data {source}: a uint16 token file must have an even size")
        return size // 2
    else:
        size = min(max_bytes, path.stat().st_size)
    if not size:
        raise ValueError(f"--data {source}: empty; give a file (or folder) with some text")
    return size


def load_tokens(source: str | Path | None, *, max_bytes: int = 16 << 20) -> torch.Tensor:
    """The token stream of ``source`` (see the module docstring), held in the narrowest
    dtype that holds it: uint8 for bytes, int32 for uint16 tokens. As int64 the default
    corpus took 128 MiB on every rank; :class:`BatchSampler` widens each batch instead.
    Raises what :func:`token_count` raises."""
    if source is None:
        return default_corpus_bytes(max_bytes)
    token_count(source, max_bytes=max_bytes)
    path = Path(source)
    if path.is_dir():
        data = b"".join(p.read_bytes() for p in _folder_files(path))[:max_bytes]
    elif path.suffix in UINT16_SUFFIXES:
        raw = bytearray(path.read_bytes())
        return torch.frombuffer(raw, dtype=torch.int16).to(torch.int32) & 0xFFFF
    else:
        data = path.read_bytes()[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _folder_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


class Batch(NamedTuple):
    inputs: torch.Tensor  # (b, T) tokens
    targets: torch.Tensor  # (b, T) the next token of each input


class BatchSampler:
    """Deterministic global batches, split across data-parallel ranks (or, with
    ``counts``, across the virtual ranks of the module docstring)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        context: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        counts: Sequence[int] | None = None,
    ) -> None:
        counts = tuple(counts) if counts is not None else (1,) * dp_size
        if len(counts) != dp_size or min(counts) < 1:
            raise ValueError(
                f"micro-batches per rank {counts}: give one count >= 1 for each of the "
                f"{dp_size} data-parallel ranks"
            )
        virtual = sum(counts)
        if global_batch % virtual:
            where = "data-parallel" if virtual == dp_size else "virtual"
            raise ValueError(
                f"global batch {global_batch} does not split over {virtual} {where} ranks; "
                f"use a multiple of {virtual}"
            )
        if tokens.numel() < context + 2:
            raise ValueError(f"the data has {tokens.numel()} tokens; need more than {context + 1}")
        self.tokens = tokens
        self.context = context
        self.global_batch = global_batch
        first = sum(counts[:dp_rank])
        per_slot = global_batch // virtual
        # Slot s of this rank: virtual rank first + s's rows.
        self.slot_rows = tuple(
            range((first + s) * per_slot, (first + s + 1) * per_slot)
            for s in range(counts[dp_rank])
        )
        self.rows = range(self.slot_rows[0].start, self.slot_rows[-1].stop)
        self.seed = seed

    @property
    def slots(self) -> int:
        """This rank's micro-batch slots per micro-step (1 without ``counts``)."""
        return len(self.slot_rows)

    def batch(self, step: int, micro_step: int = 0, slot: int = 0) -> Batch:
        """Slot ``slot``'s sequences of micro-step ``micro_step`` of step ``step``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro_step)
        limit = self.tokens.numel() - self.context - 1
        offsets = torch.randint(0, limit, (self.global_batch,), generator=generator, device="cpu")
        rows = self.slot_rows[slot]
        mine = offsets[rows.start : rows.stop]
        index = mine[:, None] + torch.arange(self.context + 1, device="cpu")  # (b, T + 1)
        window = self.tokens[index].to(torch.int64)
        return Batch(window[:, :-1], window[:, 1:])
