"""``ZeroTrainer``: ``transformers.Trainer`` with zero_core's engine in place of DDP.

The Trainer's backends are a closed set (DDP, DeepSpeed and FSDP branches inside it and
Accelerate), with no plugin hook, so ZeroTrainer is a subclass that takes over the points
where the Trainer hands the model, its gradients and its optimizer state to a backend. It
is tested on the versions in TESTED_VERSIONS; several of the methods it overrides are
private to the Trainer (marked "private" below) and may change in another release.

What it overrides, and why:

=====================================  ======================================================
``create_accelerator_and_postprocess``  the Trainer's ``Accelerator`` becomes a
                                        :class:`ZeroAccelerator`: ``backward`` is
                                        ``engine.backward``, ``clip_grad_norm_`` the engine's
                                        global-norm clipping, and the optimizer is prepared
                                        without a state-dict round trip
``create_optimizer``                    the Trainer's optimizer (``args.optim``, its weight
                                        decay groups) is built as usual, then given to
                                        ``zero_core.initialize``, which builds the engine over
                                        it; the Trainer then holds an
                                        :class:`EngineOptimizer` whose ``step()`` is
                                        ``engine.step()`` and whose ``param_groups`` are the
                                        engine optimizer's (so the Trainer's scheduler drives
                                        the engine's learning rate)
``_wrap_model`` (private)               returns the engine as the wrapped model, so the
                                        Trainer never calls ``accelerator.prepare(model)``:
                                        no DistributedDataParallel; forward, ``train()``,
                                        ``eval()``, ``zero_grad()`` and ``parameters()`` are
                                        the engine's
``save_model``                          the weights are the engine's float32 master weights,
                                        gathered to rank 0 (``engine.full_state_dict``); at
                                        stage 3 the module holds only placeholders
``_save_optimizer_and_scheduler``       ``engine.save(<checkpoint>/zero_state)`` (sharded,
(private)                               every rank) instead of ``optimizer.pt``; the
                                        scheduler as the Trainer saves it
``_load_optimizer_and_scheduler``       ``engine.load`` of that folder: master weights,
(private)                               optimizer states, on any world size and stage
``_load_from_checkpoint`` (private)     nothing: the weights come back with the engine's
                                        state (float32, not the rounded export)
=====================================  ======================================================

The Trainer's own loop is unchanged: ``training_step``, ``compute_loss``, gradient
accumulation, ``_clip_grad_norm`` and ``_get_grad_norm`` (they call the accelerator's
methods above), logging, evaluation, the data loaders, RNG state and checkpoint rotation.

Refused at construction, each naming what to use: ``fp16``/``bf16`` (use
``ZeroConfig(param_dtype=...)``), ``deepspeed``/``fsdp``, several GPUs in one process,
``model_init``, ``load_best_model_at_end``, ``torch_compile``, a model on the meta device
without ``init_values``, a ZeroConfig with ``clip_grad_norm`` (use ``max_grad_norm``) or
another ``gradient_accumulation_steps`` than the arguments'. While training, an
accumulation window cut short by the end of an epoch raises (EngineOptimizer).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import accelerate
import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME

import zero_comm

from ..config.zero_config import ZeroConfig
from ..engine import Engine
from ..init_values import InitValues
from ..initialize import initialize
from .accelerator import ZeroAccelerator
from .communicator import adopted_communicator
from .optimizer import EngineOptimizer

# The versions ZeroTrainer is tested with (noxfile.py's integrations session installs them).
TESTED_VERSIONS = {"transformers": "5.24.0", "accelerate": "1.15.0"}
# The engine's sharded state, in each of the Trainer's checkpoint-<step> folders.
ENGINE_STATE = "zero_state"


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training ``model`` with a zero_core engine (see the module).

    Args:
        model: a model built whole (on the CPU or ``args.device``), or on the meta device
            with ``init_values``; the engine takes it over when training starts.
        args: the Trainer's ``TrainingArguments``; ``gradient_accumulation_steps`` and
            ``max_grad_norm`` are the engine's.
        zero_config: the engine's configuration (stage, ``param_dtype``, buckets, offload).
        comm: the data-parallel communicator; default: a deterministic one over the
            processes Accelerate set up (every stage then gives the same bits).
        init_values: for a model built on the meta device (no rank holds it whole): its
            values, as ``zero_core.initialize(..., init_values=...)`` takes them (a state
            dict, ``(name, tensor)`` pairs, ``zero_core.values_from_reset_parameters``);
            read when training starts, when the engine is built.
        **kwargs: the Trainer's other arguments (datasets, collator, callbacks,
            ``optimizers=(optimizer, scheduler)``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *,
        zero_config: ZeroConfig,
        comm: zero_comm.Communicator | None = None,
        init_values: InitValues | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unsupported(model, args, zero_config, kwargs, init_values)
        self.init_values = init_values
        steps = args.gradient_accumulation_steps
        self.zero_config = dataclasses.replace(zero_config, gradient_accumulation_steps=steps)
        self.engine: Engine | None = None
        super().__init__(model=model, args=args, **kwargs)
        self.comm = comm if comm is not None else adopted_communicator(self.args.world_size)

    # ------------------------------------------------------------ the backend
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is not accelerate.Accelerator:
            raise TypeError(
                f"ZeroTrainer: the Trainer made a {type(self.accelerator).__name__}, not an "
                "Accelerator; ZeroTrainer is tested with transformers "
                f"{TESTED_VERSIONS['transformers']}"
            )
        # The Trainer builds Accelerator(**args) inline; the subclass only overrides
        # methods and adds one class-level attribute, so the instance can take it on.
        self.accelerator.__class__ = ZeroAccelerator

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the Trainer's optimizer, then the engine over it (once)."""
        if self.engine is not None:  # a second train(): the same engine goes on
            return EngineOptimizer(self.engine) if self.optimizer is None else self.optimizer
        optimizer = super().create_optimizer(model)
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"ZeroTrainer needs a model (nn.Module), got {type(self.model)}")
        engine = initialize(
            self.model, optimizer, self.zero_config, self.comm, init_values=self.init_values
        )
        self.init_values = None  # consumed (an iterator is read once)
        self.engine = engine
        self.accelerator.zero_engine = engine
        engine_optimizer = EngineOptimizer(engine)
        self.optimizer = engine_optimizer
        return engine_optimizer

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        # A model on the meta device gets its values (on the communicator's device) from
        # the engine, through init_values; torch cannot move a meta tensor.
        if any(p.is_meta for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        # The engine is the wrapped model: the Trainer calls accelerator.prepare(model)
        # only when _wrap_model returns self.model, and never wraps the engine in DDP.
        return self.engine if self.engine is not None else model

    # ------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective once the engine exists: rank 0 writes the model (``save_pretrained``)
        with the engine's float32 master weights."""
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        state = self.engine.full_state_dict(rank=0)  # every rank gathers; rank 0 keeps
        self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self._built_engine()
        engine.save(Path(output_dir) / ENGINE_STATE)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint) / ENGINE_STATE
        if not folder.is_dir():
            raise FileNotFoundError(
                f"[rank {self.comm.rank}] {checkpoint} has no {ENGINE_STATE}/: resume a "
                "ZeroTrainer from a checkpoint a ZeroTrainer saved"
            )
        self._built_engine().load(folder)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come back with the engine's state in _load_optimizer_and_scheduler
        # (float32 masters, not the exported copy), once the engine is built.
        return

    def _built_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("ZeroTrainer: the engine is built when training starts")
        return self.engine


def _refuse_unsupported(
    model: nn.Module,
    args: TrainingArguments,
    config: ZeroConfig,
    kwargs: dict[str, Any],
    init_values: InitValues | None,
) -> None:
    """One ValueError naming every setting ZeroTrainer cannot honour, with the fix."""
    problems = []
    if args.fp16 or args.bf16:
        problems.append(
            "fp16/bf16 (Accelerate's autocast): set ZeroConfig(param_dtype='bf16' or 'fp16'); "
            "the engine keeps float32 master weights"
        )
    if args.n_gpu > 1:
        problems.append(
            f"{args.n_gpu} GPUs in one process (the Trainer's DataParallel): launch one process "
            "per GPU (torchrun --nproc-per-node N)"
        )
    if args.deepspeed or args.fsdp:
        problems.append("deepspeed/fsdp: ZeroTrainer is the ZeRO backend; leave them unset")
    if args.torch_compile:
        problems.append("torch_compile: not tested with the engine; leave it False")
    if args.load_best_model_at_end:
        problems.append("load_best_model_at_end: not supported yet; load the checkpoint yourself")
    if kwargs.get("model_init") is not None:
        problems.append("model_init: the engine trains one model; pass model=")
    if config.clip_grad_norm is not None:
        problems.append(
            f"ZeroConfig(clip_grad_norm={config.clip_grad_norm}): the Trainer clips; set "
            "TrainingArguments(max_grad_norm=...) instead"
        )
    steps = config.gradient_accumulation_steps
    if steps not in (1, args.gradient_accumulation_steps):
        problems.append(
            f"ZeroConfig(gradient_accumulation_steps={steps}) differs from "
            f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps})"
            ": set it in TrainingArguments only"
        )
    counts = config.micro_batches_per_rank
    if counts is not None and (counts == "auto" or any(c != 1 for c in counts)):
        # The Trainer's loop gives every rank the same batches, one backward each, and
        # steps every gradient_accumulation_steps on every rank alike; rank i of
        # micro_batches_per_rank needs c_i backward calls per micro-step, each on a batch
        # of its own. Run as is, the ranks would meet in different collectives.
        given = counts if counts == "auto" else list(counts)
        problems.append(
            f"ZeroConfig(micro_batches_per_rank={given!r}): the Trainer gives every rank "
            "the same batches and one backward per batch, but rank i must run c_i backward "
            "calls per micro-step; remove it (shard_weights is supported), or train with "
            "zero-train --micro-batches-per-rank or your own loop (docs/mixed-hardware.md)"
        )
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta and init_values is None:
        problems.append(
            f"the model is on the meta device ({meta[0]}, ...) and no init_values: pass "
            "ZeroTrainer(..., init_values=...) (a state dict, (name, tensor) pairs, or "
            "zero_core.values_from_reset_parameters(model))"
        )
    if problems:
        raise ValueError("ZeroTrainer cannot honour: " + "; ".join(problems))


__all__ = ["ENGINE_STATE", "TESTED_VERSIONS", "ZeroTrainer"]
