"""``ZeroPrecision``: Lightning's precision plugin, routed to the engine.

Lightning sends backward, the optimizer step and gradient clipping through the strategy's
precision plugin. Under ZeroStrategy each goes to the engine, which owns all three: the
compute dtype is the engine's ``param_dtype`` (so no ``torch.autocast``, and no
``GradScaler``: float16's loss scaling is the engine's), ``backward`` is
``engine.backward``, the step is ``engine.step()``, and clipping is
``engine.clip_grad_norm_`` (the global norm over every rank's shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    from ..engine import Engine


class ZeroPrecision(Precision):
    """The precision plugin ZeroStrategy installs in place of the Trainer's: it keeps the
    Trainer's precision name (``precision``), and the engine does the rest."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        # Lightning reads it (summaries, checks); a name check_precision accepted.
        self.precision = precision  # type: ignore[assignment]
        self.engine: Engine | None = None  # set by the strategy once it has built one

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError(
                "ZeroPrecision has no engine yet: it is used through ZeroStrategy, which "
                "builds the engine in Trainer.fit's setup"
            )
        return self.engine

    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``engine.backward(loss)``. Lightning divided the loss by
        ``accumulate_grad_batches`` already; the engine divides the summed gradients by
        its accumulation steps (and the world size) itself, so the loss is multiplied
        back first: the mean over the micro-batches is taken once, not twice."""
        if args or kwargs:
            raise TypeError(
                "ZeroStrategy: backward arguments (e.g. manual_backward(loss, retain_graph=...)) "
                "are not supported; the engine runs one backward per micro-batch"
            )
        accumulate = model.trainer.accumulate_grad_batches if model.automatic_optimization else 1
        self._engine().backward(tensor * accumulate if accumulate > 1 else tensor)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training_step and backward), Lightning's before-step hooks
        and clipping, then ``engine.step()``; returns the closure's result, as an
        optimizer's ``step(closure)`` does."""
        if kwargs:
            raise TypeError(
                f"ZeroStrategy: optimizer.step({', '.join(kwargs)}=...) is not supported"
            )
        result = closure()
        self._after_closure(model, optimizer)
        self._engine().step()
        return result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """The global L2 norm over every rank's gradients, by the engine."""
        self._engine().clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        raise ValueError(
            "ZeroStrategy clips by the global norm only: use Trainer(gradient_clip_val=..., "
            "gradient_clip_algorithm='norm')"
        )
