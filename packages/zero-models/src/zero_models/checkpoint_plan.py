"""The plan that checkpoints a GPT's blocks, applied after the model is built (gpt.py has no
checkpointing code, as it has no parallel code).

    mode "none"          every block keeps all it saves for backward
    mode "full"          each block keeps only its input x (B, T, C) and recomputes in backward
    mode "partitioned"   P_a: each of the p tensor-parallel ranks keeps 1/p of x and the block
                         gathers it before recomputing (zero_core.ActivationCheckpointing)

``offload`` keeps the kept pieces in host memory (P_a+cpu); ``contiguous`` copies them into
one pre-allocated arena (M_D). Parameter names and the module tree are unchanged, so
checkpoints (the saved-model kind) and ZeRO stage 3's fetch units see the same model.
"""

from __future__ import annotations

from typing import Literal

from zero_comm import Communicator
from zero_core import ActivationCheckpointing

from .gpt import GPT

CheckpointMode = Literal["none", "full", "partitioned"]
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("none", "full", "partitioned")


def checkpoint_gpt_blocks(
    model: GPT,
    mode: CheckpointMode,
    tp: Communicator | None = None,
    *,
    offload: bool = False,
    contiguous: bool = True,
) -> ActivationCheckpointing | None:
    """Make every block of ``model`` checkpointed; returns the checkpointing (its memory
    and gather counters), or None for mode "none"."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint mode {mode!r} is not one of {CHECKPOINT_MODES}")
    if mode == "none":
        if offload:
            raise ValueError("offloading checkpoints needs checkpointing: choose mode 'full' or "
                             "'partitioned'")  # fmt: skip
        return None
    checkpointing = ActivationCheckpointing(
        tp, partition=mode == "partitioned", offload=offload, contiguous=contiguous,
        slots=len(model.blocks),
    )  # fmt: skip
    for block in model.blocks:
        # nn.Module.__call__ runs hooks, then self.forward: the instance attribute wins.
        run_block = block.forward
        block.forward = lambda x, run_block=run_block: checkpointing(run_block, x)
    return checkpointing
