"""``DeepSpeedEngine``: the core Engine behind DeepSpeed's engine API, as an ``nn.Module``.

    engine, optimizer, loader, scheduler = zero_core.deepspeed.initialize(...)
    loss = engine(batch)              # the module's forward
    engine.backward(loss)
    engine.step()                     # applies the update at each accumulation boundary
    engine.save_checkpoint(DIR, client_state={"epoch": 3})

It is a module holding the user's model as ``engine.module`` (so ``engine.parameters()``,
``train()``, ``eval()`` and ``state_dict()`` act on it, keys prefixed ``module.``, as
DeepSpeed's), and the core ``zero_core.Engine`` as ``engine.core``. Attributes neither has
reach the model, as DeepSpeed's engine forwards them. Keyword options of DeepSpeed's
methods that would change what the engine does are refused by name when given a value
other than their default; those that change nothing here are accepted.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.format import CheckpointError
from ..checkpoint.reader import complete_checkpoint
from ..engine import Engine
from . import client_state as client_states
from .unsupported import refuse_unless_default, unsupported

CLIENT_STATE = "client_state"  # its key in the checkpoint's extra


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's engine methods over a core :class:`zero_core.Engine` (module doc)."""

    def __init__(self, core: Engine, micro_batch_size: int | None) -> None:
        """``core``: the engine zero_core.initialize built; ``micro_batch_size``: the
        config's train_micro_batch_size_per_gpu (None if it gives no batch size)."""
        super().__init__()
        self.module = core.module
        self.core = core
        self._micro_batch_size = micro_batch_size
        self.micro_steps = 0  # step() calls, as DeepSpeed counts micro-steps
        self._step_applied = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules ("module")
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        if name.startswith("__") or "module" not in modules:
            raise AttributeError(name)
        try:
            return getattr(modules["module"], name)
        except AttributeError:
            raise AttributeError(
                f"neither the DeepSpeed engine nor its module "
                f"({type(modules['module']).__name__}) has an attribute {name!r}"
            ) from None

    # -------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (inputs cast to the compute dtype: ZeroConfig)."""
        return self.core(*args, **kwargs)

    def backward(
        self,
        loss: torch.Tensor,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
    ) -> torch.Tensor:
        """Backward of ``loss`` and the reduction of its gradients; returns ``loss``.

        The gradients are averaged over ranks and accumulation steps at the step (the
        same result as DeepSpeed's scaling of the loss by 1/accumulation steps)."""
        refuse_unless_default(
            "engine.backward",
            {
                "retain_graph": (retain_graph, False, "the engine frees the graph"),
                "scale_wrt_gas": (
                    scale_wrt_gas,
                    True,
                    "gradients are always averaged over accumulation steps",
                ),
                "allreduce_gradients": (
                    allreduce_gradients,
                    True,
                    "gradients are always reduced during backward",
                ),
            },
        )
        self.core.backward(loss)
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Apply the update at an accumulation boundary (every
        ``gradient_accumulation_steps()`` calls); the learning-rate scheduler is stepped
        after each applied update, as DeepSpeed does."""
        refuse_unless_default(
            "engine.step",
            {"lr_kwargs": (lr_kwargs, None, "the scheduler is stepped without arguments")},
        )
        self._step_applied = self.core.step()
        self.micro_steps += 1

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` applied an update (False between boundaries and
        when a float16 overflow skipped it)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch now in progress ends an accumulation (its ``step()``
        applies the update): DeepSpeed's ``(micro_steps + 1) % accumulation == 0``."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do after ``step()`` (it drops the gradients itself). Between
        micro-steps of an accumulation it raises: dropping the gradients accumulated so
        far is what DeepSpeed does at stage 0 and not at stages 1-2, so no choice here
        would be what every script expects. ``set_to_none`` changes nothing: the
        engine's gradients are dropped either way."""
        if self.core.micro_steps:
            raise RuntimeError(
                f"[rank {self.global_rank}] engine.zero_grad() after {self.core.micro_steps} "
                f"of {self.gradient_accumulation_steps()} accumulation micro-steps would drop "
                "their gradients: call it after engine.step(), or not at all (step() drops "
                "the gradients it applied)"
            )
        self.core.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """The core engine's ``clip_grad_norm_`` (the global norm over every rank)."""
        clip = getattr(self.core, "clip_grad_norm_", None)
        if clip is None:
            raise unsupported(
                "engine.clip_grad_norm_ (this zero_core has none)",
                'set "gradient_clipping" in the DeepSpeed config',
            )
        if norm_type != 2.0:
            raise unsupported(f"engine.clip_grad_norm_(norm_type={norm_type!r})", "use 2.0")
        return clip(max_norm)

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Collective: write ``save_dir/<tag>/`` (default ``global_step<N>``) and point
        ``save_dir/latest`` at it; other files of ``save_dir`` are left alone.
        ``client_state`` comes back from :meth:`load_checkpoint` (client_state.py says
        what it may hold; the rest is refused before anything is written). Returns True."""
        refuse_unless_default(
            "engine.save_checkpoint",
            {
                "save_latest": (save_latest, True, "every save points 'latest' at its tag"),
                "exclude_frozen_parameters": (
                    exclude_frozen_parameters,
                    False,
                    "frozen parameters are always saved",
                ),
            },
        )
        extra = {CLIENT_STATE: client_states.encode(client_state or {})}
        self.core.save(save_dir, extra, tag=None if tag is None else str(tag))
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Collective: continue from ``load_dir/latest`` (or ``load_dir/<tag>``).
        Returns ``(checkpoint folder, client_state)``, or ``(None, None)`` with a warning
        when there is nothing to load there, as DeepSpeed does."""
        refuse_unless_default(
            "engine.load_checkpoint",
            {
                "load_module_strict": (load_module_strict, True, "every tensor is loaded"),
                "load_optimizer_states": (load_optimizer_states, True, "the whole state loads"),
                "load_lr_scheduler_states": (
                    load_lr_scheduler_states,
                    True,
                    "the scheduler's state is loaded with the rest",
                ),
                "load_module_only": (
                    load_module_only,
                    False,
                    "load the weights into the model before initialize instead",
                ),
                "custom_load_fn": (custom_load_fn, None, "the engine reads its own format"),
            },
        )
        folder = Path(load_dir) if tag is None else Path(load_dir) / str(tag)
        found = complete_checkpoint(folder) if folder.is_dir() else None
        everyone = self.core.comm.all_gather_object(found is not None)
        if any(everyone) and not all(everyone):
            seen = ", ".join(
                f"rank {r}: {'found' if f else 'none'}" for r, f in enumerate(everyone)
            )
            raise CheckpointError(
                f"[rank {self.global_rank}] the ranks disagree on whether {folder} holds a "
                f"checkpoint ({seen}): put it on a file system every rank sees"
            )
        if found is None:
            if self.global_rank == 0:
                warnings.warn(
                    f"load_checkpoint: no checkpoint at {folder}; nothing was loaded "
                    "(returning None, None)",
                    stacklevel=2,
                )
            return None, None
        extra = self.core.load(load_dir, tag=None if tag is None else str(tag))
        return str(found), client_states.decode(extra.get(CLIENT_STATE, {}))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``module.``-prefixed state dict, as DeepSpeed's; refused at stage 3, where the
        module's parameters are placeholders (the whole values are
        ``engine.core.full_state_dict()``, or ``GatheredParameters``)."""
        if self.zero_optimization_stage() == 3:
            raise RuntimeError(
                "engine.state_dict() at stage 3 would hold placeholders, not weights: use "
                "engine.core.full_state_dict() (float32, collective), save_checkpoint, or "
                "read parameters inside zero.GatheredParameters"
            )
        return super().state_dict(*args, **kwargs)

    # --------------------------------------------------------------- queries
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the engine steps (over its float32 master weights)."""
        return self.core.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler stepped after every applied update, or None."""
        return self.core.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.core.lr_scheduler = scheduler

    @property
    def global_steps(self) -> int:
        """Updates applied so far."""
        return self.core.global_steps

    @property
    def skipped_steps(self) -> int:
        """Updates skipped (float16 overflow)."""
        return self.core.skipped_steps

    @property
    def global_samples(self) -> int:
        return self.global_steps * (self.train_batch_size() or 0)

    @property
    def global_rank(self) -> int:
        return self.core.comm.rank

    @property
    def world_size(self) -> int:
        """The data-parallel world size."""
        return self.core.comm.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index on its node (the launcher's LOCAL_RANK; 0 without one)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        return self.core.comm.device

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.core.config.gradient_accumulation_steps

    def train_batch_size(self) -> int | None:
        """micro batch x accumulation steps x data-parallel ranks."""
        micro = self._micro_batch_size
        if micro is None:
            return None
        return micro * self.gradient_accumulation_steps() * self.world_size

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer group now."""
        return [float(group["lr"]) for group in self.core.optimizer.param_groups]

    def zero_optimization_stage(self) -> int:
        return self.core.config.stage

    def bfloat16_enabled(self) -> bool:
        return self.core.dtype is torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.core.dtype is torch.float16

    def gradient_clipping(self) -> float:
        """The config's gradient_clipping (0.0: none)."""
        return float(self.core.config.clip_grad_norm or 0.0)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last applied update, measured where clipping
        is configured (``gradient_clipping``); None before, or without clipping."""
        return self.core.last_grad_norm
