"""``OUT/metrics.jsonl``: what a zero-train run computed under, then one line per step.

    {"run": {"fingerprint": {...}, "corpus": "sha256:...", "first_step": 0, "argv": [...]}}
    {"step": 0, "loss": 5.3277..., "lr": ..., "tokens_per_s": ..., ...}
    {"step": 1, ...}

The first line of every run (a resumed run appends its own) is its *run record*: the
fingerprint of rank 0 (zero_comm.determinism: torch, BLAS, CPU, threads per rank, ...) and
the digest of the token stream, which together say what the losses' bits depend on. Two
runs with equal run records and options give equal losses, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, TextIO

import torch

DIGEST_CHUNK = 1 << 20  # tokens widened to int64 at a time (8 MiB)


def corpus_digest(tokens: torch.Tensor) -> str:
    """sha256 of the token stream as int64, whatever dtype holds it, so runs on other data
    are told apart; widened a chunk at a time, never the whole stream at once."""
    digest = hashlib.sha256()
    flat = tokens.reshape(-1)
    for start in range(0, flat.numel(), DIGEST_CHUNK):
        chunk = flat[start : start + DIGEST_CHUNK].to(torch.int64).contiguous()
        digest.update(chunk.numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def open_metrics(path: Path, run_record: dict[str, Any], *, append: bool) -> TextIO:
    """Open (append for a resumed run) and write the run record as the run's first line."""
    metrics = path.open("a" if append else "w")
    metrics.write(json.dumps({"run": run_record}) + "\n")
    metrics.flush()
    return metrics


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(run records, step records) of a metrics file, each in file order."""
    runs: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "run" in record:
            runs.append(record["run"])
        else:
            steps.append(record)
    return runs, steps
