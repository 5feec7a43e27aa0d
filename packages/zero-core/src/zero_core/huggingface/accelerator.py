"""``ZeroAccelerator``: the Trainer's ``Accelerator``, with the engine doing what DDP did.

``transformers.Trainer`` calls three ``Accelerator`` methods around the model that assume
DDP; this subclass gives each to the engine:

- ``backward(loss)``: ``engine.backward(loss * A)``. The Trainer has already divided the
  loss for its ``gradient_accumulation_steps`` A (by A, or by the window's token count);
  the engine divides the summed gradients by N x A itself, so the A is given back. For a
  power of two A both are exact, and the gradient is DDP's to the bit of the sum's order.
- ``clip_grad_norm_(parameters, max_norm)``: ``engine.clip_grad_norm_(max_norm)``, the
  global norm of the reduced gradients (torch's over ``p.grad`` would raise: the
  gradients are not there). ``max_norm=inf`` (the Trainer's "norm only") computes the
  norm and clips nothing.
- ``prepare_optimizer``: an :class:`~zero_core.huggingface.optimizer.EngineOptimizer`
  is wrapped without device placement (no state-dict round trip).

``prepare_model`` of a model the engine trains raises (zero_core.accelerate_guard); the
Trainer never asks, since ZeroTrainer hands it the engine as the wrapped model.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
from accelerate import Accelerator

from ..engine import Engine
from .optimizer import AcceleratedEngineOptimizer, EngineOptimizer, check_window_complete


class ZeroAccelerator(Accelerator):
    """An ``Accelerator`` whose backward, clipping and optimizer go through ``zero_engine``.

    ZeroTrainer turns the Trainer's own ``Accelerator`` into one (the Trainer builds it
    inline, with no factory to override) and sets ``zero_engine`` when it builds the
    engine; the subclass adds no state of its own beyond that attribute."""

    zero_engine: Engine | None = None

    def _engine(self, what: str) -> Engine:
        if self.zero_engine is None:
            raise RuntimeError(
                f"ZeroAccelerator.{what} before ZeroTrainer built the engine: it is built when "
                "training starts (trainer.train())"
            )
        return self.zero_engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward`` of the Trainer's loss, its accumulation divisor given back."""
        if kwargs:
            raise ValueError(
                f"ZeroAccelerator.backward({', '.join(kwargs)}=...): the engine's backward "
                "takes only the loss"
            )
        engine = self._engine("backward")
        steps = engine.config.gradient_accumulation_steps
        engine.backward(loss * steps if steps != 1 else loss)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """The engine's global-norm clipping; ``parameters`` must be the model's."""
        engine = self._engine("clip_grad_norm_")
        check_window_complete(engine)  # the Trainer clips just before it steps
        # A norm with nothing clipped: the engine takes finite bounds only, and no norm of
        # float32 gradients reaches the largest float.
        bound = max_norm if math.isfinite(max_norm) else sys.float_info.max
        return engine.clip_grad_norm_(bound, norm_type)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        if isinstance(optimizer, EngineOptimizer):
            prepared = AcceleratedEngineOptimizer(optimizer)
            self._optimizers.append(prepared)
            return prepared
        return super().prepare_optimizer(optimizer, device_placement=device_placement)
