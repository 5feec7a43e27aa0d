"""Rank bodies of tests/test_huggingface_trainer.py: examples/huggingface_trainer.py's
Trainers on real ranks (zero_comm.testing.run_on_ranks runs them; they report JSON)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import zero_comm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "huggingface_trainer.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("huggingface_trainer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def train(
    example: ModuleType,
    folder: str,
    stage: int | None,
    resume: str | None = None,
    zero_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """One Trainer run: its logged losses and gradient norms, its evaluation loss after
    training, and its final float32 weights (the engine's master weights; the plain
    Trainer's module)."""
    history = example.LossHistory()
    args = example.arguments(folder, **overrides)
    trainer = example.make_trainer(args, stage, history, **(zero_options or {}))
    trainer.train(resume_from_checkpoint=resume)
    evaluation = trainer.evaluate(example.counting_data(rows=8))["eval_loss"]
    if stage is None:
        state = {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
    else:
        state = trainer.engine.full_state_dict()
    return {"losses": history.losses, "norms": history.grad_norms, "state": state,
            "eval_loss": evaluation}  # fmt: skip


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Whether two final states are equal bit for bit, and their largest difference."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    largest = max((a[k] - b[k]).abs().max().item() for k in a)
    return {"equal": all(torch.equal(a[k], b[k]) for k in a), "max_diff": largest}


def stages_accumulation_clipping(comm: zero_comm.Communicator, folder: str) -> dict[str, Any]:
    """Stages 0-3 and the plain Trainer (DDP), with max_grad_norm=1.0 (it clips: the norms
    are 2-3), with accumulation over 2 micro-batches, without clipping; and stages 0 and 3
    in bf16 (ZeroConfig(param_dtype="bf16"), which the plain Trainer's autocast is not)."""
    example = load_example()
    report: dict[str, Any] = {}
    cases: dict[str, dict[str, Any]] = {
        "plain": {},
        "accumulation": {"gradient_accumulation_steps": 2},
        "unclipped": {"max_grad_norm": 0.0},
        "bf16": {"zero_options": {"param_dtype": "bf16"}},
        # Memory-weighted shards (docs/mixed-hardware.md): the engine's layout alone, so
        # the plain case's stage 0 bits.
        "weighted": {"zero_options": {"shard_weights": (2, 1)}},
    }
    stages_of = {"plain": (0, 1, 2, 3), "accumulation": (0, 3), "unclipped": (2,), "bf16": (0, 3),
                 "weighted": (2, 3)}  # fmt: skip
    plain_state: dict[str, torch.Tensor] = {}  # the plain case's stage 0 (it runs first)
    for case, overrides in cases.items():
        runs = {s: train(example, f"{folder}/{case}-{s}", s, **overrides) for s in stages_of[case]}
        first = runs[stages_of[case][0]]
        report[case] = {
            "losses": {s: r["losses"] for s, r in runs.items()},
            "norms": {s: r["norms"] for s, r in runs.items()},
            "eval_losses": {s: r["eval_loss"] for s, r in runs.items()},
            "stages": {s: differences(first["state"], r["state"]) for s, r in runs.items()},
        }
        if case == "weighted":
            report[case]["plain_stage_0"] = differences(plain_state, first["state"])
        elif case != "bf16":  # the plain Trainer's bf16 is autocast: another computation
            ddp = train(example, f"{folder}/{case}-ddp", None, **overrides)
            report[case].update(
                ddp_losses=ddp["losses"], ddp_norms=ddp["norms"], ddp_eval_loss=ddp["eval_loss"],
                ddp=differences(first["state"], ddp["state"]),
            )  # fmt: skip
        if case == "plain":
            plain_state = first["state"]
            meta = train_built_on_meta(example, f"{folder}/meta")
            report["meta"] = {
                "losses": meta["losses"],
                **differences(first["state"], meta["state"]),
            }
        if case == "unclipped":
            report[case]["clipped_vs_unclipped"] = differences(plain_state, first["state"])
    return report


def train_built_on_meta(example: ModuleType, folder: str) -> dict[str, Any]:
    """Stage 3 with the model built on the meta device and its values given as init_values
    (here the state dict of the model the other runs build whole, so the runs compare)."""
    from transformers import AutoModelForCausalLM

    from zero_core import ZeroConfig
    from zero_core.huggingface import ZeroTrainer

    values = example.tiny_gpt2().state_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(example.tiny_gpt2().config)
    history = example.LossHistory()
    trainer = ZeroTrainer(
        model, example.arguments(folder), zero_config=ZeroConfig(stage=3), init_values=values,
        train_dataset=example.counting_data(), callbacks=[history],
    )  # fmt: skip
    trainer.train()
    return {"losses": history.losses, "state": trainer.engine.full_state_dict()}


def save_and_resume(
    comm: zero_comm.Communicator, folder: str, stage: int, resume_stage: int
) -> dict[str, Any]:
    """4 steps at ``stage`` saving every 2, then a new ZeroTrainer at ``resume_stage``
    resumed from checkpoint-2 (the engine loads a checkpoint of any stage)."""
    example = load_example()
    saving = {"save_strategy": "steps", "save_steps": 2}
    whole = train(example, f"{folder}/whole", stage, **saving)
    checkpoint = f"{folder}/whole/checkpoint-2"
    resumed = train(example, f"{folder}/resumed", resume_stage, checkpoint, **saving)
    exported: dict[str, Any] = {}
    if comm.rank == 0:
        from safetensors.torch import load_file

        saved = load_file(f"{folder}/whole/checkpoint-4/model.safetensors")
        exported = {k: torch.equal(v, whole["state"][k]) for k, v in saved.items()}
    return {
        "whole_losses": whole["losses"],
        "resumed_losses": resumed["losses"],
        "resumed": differences(whole["state"], resumed["state"]),
        "exported": exported,
        "files": sorted(p.name for p in Path(f"{folder}/whole/checkpoint-2").iterdir()),
    }
