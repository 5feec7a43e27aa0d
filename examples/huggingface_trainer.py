"""The Hugging Face Trainer with ZeRO: ``zero_core.huggingface.ZeroTrainer``.

    zero-launch -n 2 python examples/huggingface_trainer.py                 # stage 3, gloo
    torchrun --nproc-per-node 2 examples/huggingface_trainer.py --stage 2
    zero-launch -n 2 python examples/huggingface_trainer.py --ddp           # the plain Trainer

It needs ``transformers`` and ``accelerate`` at the versions tested (``pip install
'zero-core[huggingface]'``, or ``./nox -s integrations``). A tiny GPT-2 (from a config:
nothing is downloaded) learns counting sequences; the script is the Trainer's usual one
with ``Trainer`` replaced by ``ZeroTrainer`` and a ``zero_config``:

    trainer = ZeroTrainer(model, args, zero_config=zero_core.ZeroConfig(stage=3),
                          train_dataset=data)
    trainer.train()

Every stage gives the same losses and weights, bit for bit (the engine's reductions are
deterministic); the plain Trainer (DDP) agrees within float rounding
(docs/huggingface-trainer.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

try:
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        PreTrainedModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from zero_core.huggingface import ZeroTrainer
except ImportError as missing:
    raise SystemExit(
        f"{__file__}: {missing}: pip install 'zero-core[huggingface]' (transformers 5.24.0, "
        "accelerate 1.15.0: the versions tested), or ./nox -s integrations"
    ) from None

import zero_core


def tiny_gpt2(seed: int = 0) -> PreTrainedModel:
    """A 2-layer GPT-2 with 64-wide embeddings, no dropout, the same values on every rank."""
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    return model


def counting_data(rows: int = 16, length: int = 16, vocab: int = 128) -> list[dict[str, Any]]:
    """Counting sequences (each token the previous plus one) from seeded starts."""
    generator = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, vocab, (rows, 1), generator=generator)
    tokens = (starts + torch.arange(length)) % vocab
    return [{"input_ids": row, "labels": row} for row in tokens]


class LossHistory(TrainerCallback):
    """The logged training loss and gradient norm of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            if logs.get("grad_norm") is not None:
                self.grad_norms.append(float(logs["grad_norm"]))


def arguments(output_dir: str, **overrides: Any) -> TrainingArguments:
    """Small, quiet, deterministic Trainer arguments: a loss logged at every step, no
    evaluation, no checkpoints unless asked for."""
    options: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=2, learning_rate=3e-3,
        weight_decay=0.1, max_steps=4, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, optim="adamw_torch", lr_scheduler_type="linear",
        warmup_steps=1, max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )  # fmt: skip
    return TrainingArguments(**{**options, **overrides})


def make_trainer(
    args: TrainingArguments, stage: int | None, history: LossHistory, **zero_options: Any
) -> Trainer:
    """ZeroTrainer at ``stage``, or with ``stage=None`` the plain Trainer (DDP)."""
    common: dict[str, Any] = dict(
        model=tiny_gpt2(), args=args, train_dataset=counting_data(), callbacks=[history]
    )
    if stage is None:
        return Trainer(**common)
    config = zero_core.ZeroConfig(stage=stage, **zero_options)
    return ZeroTrainer(**common, zero_config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    parser.add_argument("--ddp", action="store_true", help="the plain Trainer, for comparison")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--output-dir", default="hf-trainer-out")
    args = parser.parse_args()
    history = LossHistory()
    training = arguments(
        args.output_dir, max_steps=args.steps, gradient_accumulation_steps=args.accumulation,
        max_grad_norm=args.max_grad_norm,
    )  # fmt: skip
    trainer = make_trainer(training, None if args.ddp else args.stage, history)
    trainer.train()
    if trainer.is_world_process_zero():
        what = "the plain Trainer (DDP)" if args.ddp else f"ZeroTrainer, stage {args.stage}"
        print(f"{what}, {training.world_size} processes")
        for step, loss in enumerate(history.losses, 1):
            print(f"step {step:3d}  loss {loss:.4f}")


if __name__ == "__main__":
    main()
