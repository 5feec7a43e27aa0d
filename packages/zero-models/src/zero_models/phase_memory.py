"""zero-train's table of measured peak memory per phase, next to the prediction.

Each rank measures its last step with zero_core.MemoryTracker; the activation peak of a
step is the highest phase peak above the resident memory at the step's start, plus the
checkpoint arena (allocated once and resident between steps). The prediction is
zero_core.estimate.activations for the same shape, tensor-parallel degree and checkpoint
mode; on the CPU the peak includes what glibc's heap keeps after tensors are freed
(run with MALLOC_MMAP_THRESHOLD_=65536 to measure tensors alone).
"""

from __future__ import annotations

from typing import Any

from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_core.memory.tracker import MemoryTracker
from zero_core.zero_r.activation_checkpoint import ActivationCheckpointing

from .gpt import GPTConfig

PHASES = ("forward", "backward", "step")
MIB = 2**20


def phase_record(
    tracker: MemoryTracker, checkpointing: ActivationCheckpointing | None
) -> dict[str, Any]:
    """This rank's last step: each phase's peak above the step's start, and the arena."""
    start = tracker.peaks["forward"].start_bytes
    arena = checkpointing.arena if checkpointing is not None else None
    return {
        "above_start": {
            p: tracker.peaks[p].peak_bytes - start for p in PHASES if p in tracker.peaks
        },
        "arena": arena.bytes_reserved if arena is not None else 0,
        "kept": checkpointing.peak_bytes_kept if checkpointing is not None else 0,
        "exact": tracker.exact,
    }


def phase_table(
    records: list[dict[str, Any]], config: GPTConfig, tokens: int, tp: int, mode: str
) -> list[str]:
    """Lines to print: one row per rank, then the prediction."""
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size, tokens)
    predicted = activation_bytes(shape, tp=tp, checkpoint=mode)  # type: ignore[arg-type]
    lines = [
        "peak memory of the last step per phase, MiB above its start "
        f"(activation checkpoints: {mode})",
        "(resident memory; glibc's heap keeps freed blocks: MALLOC_MMAP_THRESHOLD_=65536 "
        "measures tensors alone)",
        "rank   forward  backward      step   kept ckpt   activation peak",
    ]
    for rank, r in enumerate(records):
        above = r["above_start"]
        peak = max(above.values()) + r["arena"]
        lines.append(
            f"{rank:4d} {above.get('forward', 0) / MIB:9.1f} {above.get('backward', 0) / MIB:9.1f} "
            f"{above.get('step', 0) / MIB:9.1f} {r['kept'] / MIB:11.1f} {peak / MIB:17.1f}"
        )
    lines.append(
        f"predicted (zero_core.estimate.activations): kept {predicted.kept / MIB:.1f}, "
        f"activation peak {predicted.peak / MIB:.1f} MiB; the paper's 12 x width x tokens x "
        f"layers = {12 * config.width * tokens * config.layers * 4 / MIB:.1f} MiB in float32"
    )
    return lines
