"""One GPT training run measured against the memory prediction, on each rank.

``train_and_measure(comm, preset, ...)`` trains a GPT preset for a few steps under
zero_core.MemoryTracker and returns, per rank, the peak of each step (highest phase peak
above the step's resident start, plus the tensors resident then: model states,
communication buffers, the checkpoint arena) next to the prediction: model states from
the paper's formula (float32 parameters and gradients; K = 8 for AdamW's moments: the
float32 parameters are the master weights at every stage), the communicator's buffers as
counted, and zero_core.estimate.activations.
Used by the memory tests and tools/diagnose/memory_chart.py (run it on real ranks: resident memory
is per process).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import zero_core
from zero_comm import Communicator
from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_core.estimate.model_states import state_bytes_per_param
from zero_models.checkpoint_plan import checkpoint_gpt_blocks
from zero_models.gpt import GPT, PRESETS
from zero_models.tp_layers import vocab_parallel_cross_entropy
from zero_models.tp_plan import make_mesh, sharded_parameters, tensor_parallel_gpt


def train_and_measure(
    comm: Communicator,
    preset: str,
    batch: int,
    stage: int,
    mode: str,
    tp: int,
    steps: int = 3,
    contiguous: bool = True,
) -> dict[str, Any]:
    # The thread count is the caller's (run_on_ranks passes it on): a probe that changed it
    # would measure another process than the one it is compared with.
    mesh = make_mesh(comm, tp)
    config = PRESETS[preset]
    model = GPT(config, seed=0)
    model_parallel = None
    if tp > 1:
        tensor_parallel_gpt(model, mesh.tp)
        model_parallel = zero_core.ModelParallel.of(mesh.tp, sharded_parameters(model))
    checkpointing = checkpoint_gpt_blocks(model, mode, mesh.tp, contiguous=contiguous)  # type: ignore[arg-type]
    engine = zero_core.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), zero_core.ZeroConfig(stage=stage),
        mesh.dp, model_parallel=model_parallel,
    )  # fmt: skip

    def arena() -> int:
        held = checkpointing.arena if checkpointing else None
        return held.bytes_reserved if held else 0

    tracker = zero_core.MemoryTracker()
    generator = torch.Generator().manual_seed(mesh.dp.rank)
    step_peaks, absolute_peaks, resident = [], [], 0
    for _ in range(steps):
        tokens = torch.randint(
            0, config.vocab_size, (batch, config.context + 1), generator=generator
        )
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        resident = engine.memory_report().total + arena()
        with tracker.phase("forward"):
            logits = engine(inputs)
            if tp > 1:
                loss = vocab_parallel_cross_entropy(logits, targets, mesh.tp)
            else:
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            del logits
        with tracker.phase("backward"):
            engine.backward(loss)
        del loss
        with tracker.phase("step"):
            engine.step()
        start = tracker.peaks["forward"].start_bytes
        step_peaks.append(tracker.step_peak() - start + resident)
        absolute_peaks.append(tracker.step_peak())
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size,
                             batch * config.context)  # fmt: skip
    params_here = sum(p.numel() for p in model.parameters())
    states = zero_core.model_state_bytes(  # float32: K = 8, the parameters are the masters
        params_here, mesh.dp.world_size, stage, optimizer_state_bytes=state_bytes_per_param(4),
        param_bytes=4, grad_bytes=4,
    ).total  # fmt: skip
    activations = activation_bytes(shape, tp=tp, checkpoint=mode)  # type: ignore[arg-type]
    report = engine.memory_report()
    return {
        "measured": step_peaks[-1],
        "step_peaks": step_peaks,
        "absolute_peaks": absolute_peaks,
        "predicted": states + report.comm_buffers + activations.peak,
        "states_counted": report.model_states,
        "states_predicted": states,
        "kept": checkpointing.peak_bytes_kept if checkpointing else None,
        "kept_predicted": activations.kept,
        "arena_allocations": checkpointing.arena.allocations
        if checkpointing and checkpointing.arena
        else 0,
        "outside_arena": checkpointing.arena.outside_arena
        if checkpointing and checkpointing.arena
        else 0,
    }
