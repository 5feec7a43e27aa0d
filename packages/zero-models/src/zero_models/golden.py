"""Golden loss files: the losses of a reference run, per step, and what their bits depend on.

    # golden losses of: zero-train --threads 1
    # fingerprint: {"torch": "2.13.0+cpu", ..., "intra_op_threads": 1, ...}
    # corpus: sha256:e183...
    # argv: ["--threads", "1"]
    1 5.327713966369629
    2 5.105240821838379
    ...

A fresh run with the same options, data and fingerprint must give these losses bit for bit
(:func:`compare_losses` with ``tolerance=0``); under another fingerprint (another CPU, BLAS,
thread count) only within a measured tolerance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple


class GoldenRun(NamedTuple):
    fingerprint: dict[str, Any]
    corpus: str  # corpus_digest of the token stream
    argv: list[str]  # zero-train's options
    losses: list[float]  # losses[i] is step i + 1's


def write_golden(path: Path, run: GoldenRun) -> None:
    lines = [
        f"# golden losses of: zero-train {' '.join(run.argv)}",
        f"# fingerprint: {json.dumps(run.fingerprint)}",
        f"# corpus: {run.corpus}",
        f"# argv: {json.dumps(run.argv)}",
        *(f"{step} {loss!r}" for step, loss in enumerate(run.losses, start=1)),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def read_golden(path: Path) -> GoldenRun:
    header: dict[str, str] = {}
    losses: list[float] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("# ") and ": " in line:
            key, value = line[2:].split(": ", 1)
            header[key] = value
        elif line.strip():
            step, loss = line.split()
            if int(step) != len(losses) + 1:
                raise ValueError(f"{path}:{number}: step {step} out of order")
            losses.append(float(loss))
    missing = {"fingerprint", "corpus", "argv"} - header.keys()
    if missing:
        raise ValueError(f"{path}: header lacks {sorted(missing)}")
    return GoldenRun(
        json.loads(header["fingerprint"]), header["corpus"], json.loads(header["argv"]), losses
    )


def loss_mismatches(
    expected: Sequence[float], actual: Sequence[float], *, tolerance: float
) -> list[str]:
    """Each step whose loss differs by more than ``tolerance`` (relative; 0 = bitwise),
    as "step 7: 4.5765... expected, 4.5766... got"; [] when all agree."""
    if len(actual) < len(expected):
        return [f"the run gave {len(actual)} losses, {len(expected)} expected"]
    return [
        f"step {step}: {want!r} expected, {got!r} got"
        for step, (want, got) in enumerate(zip(expected, actual, strict=False), start=1)
        if abs(got - want) > tolerance * abs(want) or (tolerance == 0 and got != want)
    ]
