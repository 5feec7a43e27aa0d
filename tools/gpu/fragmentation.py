"""M_D on a GPU: fragmentation with and without the checkpoint arena (used by tools/gpu/check.py).

A GPT preset trains with every block checkpointed, once with the checkpoints copied into
one pre-allocated arena (``contiguous=True``) and once kept where they were produced. After
each step's backward (the highest point) it records, on CUDA:

    allocated   bytes handed out by PyTorch's caching allocator (max over the step)
    reserved    bytes the allocator holds from the driver (max over the step)
    free_in_reserved = reserved - allocated: fragmentation the step paid for
    largest_free    the largest free block inside reserved segments (memory_snapshot)

On the CPU (``--allow-cpu``, to test the script) only the resident peak is reported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from zero_models.checkpoint_plan import checkpoint_gpt_blocks
from zero_models.gpt import GPT, PRESETS


def largest_free_block(device: torch.device) -> int:
    """The largest inactive block in the caching allocator's segments (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    sizes = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    return max(sizes, default=0)


def run_fragmentation(
    comm: zero_comm.Communicator, preset: str, batch: int, steps: int, contiguous: bool
) -> dict[str, Any]:
    config = PRESETS[preset]
    device = comm.device
    model = GPT(config).to(device)
    checkpointing = checkpoint_gpt_blocks(model, "full", contiguous=contiguous)
    engine = zero_core.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4),
        zero_core.ZeroConfig(stage=2, param_dtype=torch.bfloat16), comm,
    )  # fmt: skip
    tracker = zero_core.MemoryTracker(device)
    generator = torch.Generator().manual_seed(0)
    per_step = []
    for _ in range(steps):
        tokens = torch.randint(
            0, config.vocab_size, (batch, config.context + 1), generator=generator
        )
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with tracker.phase("forward"):
            logits = engine(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
            del logits
        with tracker.phase("backward"):
            engine.backward(loss)
        del loss
        engine.step()
        if device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
        else:
            allocated = reserved = tracker.step_peak(("forward", "backward"))
        per_step.append({
            "allocated": allocated,
            "reserved": reserved,
            "free_in_reserved": reserved - allocated,
            "largest_free": largest_free_block(device),
        })  # fmt: skip
    arena = checkpointing.arena if checkpointing is not None else None
    last = per_step[-1]
    return {
        "preset": preset,
        "contiguous": contiguous,
        "steps": per_step,
        "free_in_reserved_mib": last["free_in_reserved"] / 2**20,
        "largest_free_mib": last["largest_free"] / 2**20,
        "reserved_mib": last["reserved"] / 2**20,
        "arena_mib": (arena.bytes_reserved if arena else 0) / 2**20,
        "outside_arena": arena.outside_arena if arena else 0,
    }


def fragmentation_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| preset | arena (M_D) | reserved MiB | reserved - allocated MiB | "
             "largest free block MiB |", "|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            arena = "yes" if r["contiguous"] else "no"
            lines.append(f"| {r['preset']} | {arena} | not run: {r['error']} | | |")
            continue
        lines.append(
            f"| {r['preset']} | {'yes' if r['contiguous'] else 'no'} | {r['reserved_mib']:.1f} | "
            f"{r['free_in_reserved_mib']:.1f} | {r['largest_free_mib']:.1f} |"
        )
    return lines
