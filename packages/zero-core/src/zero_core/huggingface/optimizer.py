"""``EngineOptimizer``: the optimizer object the Trainer steps, stepping the engine.

The Trainer calls ``optimizer.step()`` once per accumulation window, builds its learning-rate
scheduler on ``optimizer.param_groups``, and calls ``optimizer.zero_grad()`` after each step.
This object turns those into the engine's protocol:

    Trainer                               engine
      optimizer.step()          ---->  engine.step() (raises unless every micro-batch of
                                       the window went through engine.backward)
      optimizer.param_groups    ---->  engine.optimizer.param_groups (the same list: a
                                       scheduler sets the learning rate the engine steps with)
      optimizer.zero_grad()     ---->  nothing after a step (the engine dropped them);
                                       raises inside a window
      state_dict/load_state_dict ---->  raise: the state is the engine's (ZeroTrainer saves it
                                       with engine.save into each checkpoint folder)

It subclasses ``torch.optim.Optimizer`` (torch's schedulers and Accelerate's ``prepare``
check for one) without calling its ``__init__``, as Accelerate's ``AcceleratedOptimizer``
does: it holds no parameters and no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

from ..engine import Engine


def check_window_complete(engine: Engine) -> None:
    """Raise unless every micro-batch of the accumulation window went through
    ``engine.backward``: the engine applies an update only then, and a step (or a clip)
    before it would drop the window's gradients."""
    if engine.is_accumulation_boundary:
        return
    steps = engine.config.gradient_accumulation_steps
    raise RuntimeError(
        f"[rank {engine.comm.rank}] the Trainer ended an accumulation window after "
        f"{engine.micro_steps} of gradient_accumulation_steps={steps} micro-batches: the "
        "engine applies an update only after all of them, so this window's gradients would "
        "be dropped. This happens at the end of an epoch whose number of batches is not a "
        f"multiple of {steps}: make it one (dataset size, per_device_train_batch_size, "
        "dataloader_drop_last) or set max_steps to end before it"
    )


class EngineOptimizer(torch.optim.Optimizer):
    """Steps ``engine`` where the Trainer steps its optimizer."""

    def __init__(self, engine: Engine) -> None:  # no super().__init__: no params of its own
        self.engine = engine
        self.last_step_applied = True
        # torch's schedulers wrap optimizer.step to see that it ran; count it as wrapped.
        self._opt_called = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.engine.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        self.engine.wait_for_update()  # a delayed update in flight writes it
        return self.engine.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """The engine's step, at the end of an accumulation window."""
        if closure is not None:
            raise ValueError("EngineOptimizer.step(closure): closures are not supported")
        check_window_complete(self.engine)
        self.last_step_applied = self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to drop after a step; inside an accumulation window it raises."""
        if self.engine.micro_steps:
            raise RuntimeError(
                f"[rank {self.engine.comm.rank}] optimizer.zero_grad() after "
                f"{self.engine.micro_steps} backward calls without a step would drop the "
                "accumulated gradients; the engine drops them after every step"
            )

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "EngineOptimizer.state_dict(): the optimizer state is the engine's, sharded over "
            "the ranks; ZeroTrainer saves it with engine.save(<checkpoint>/zero_state)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(
            "EngineOptimizer.load_state_dict(): the optimizer state is the engine's; resume "
            "with trainer.train(resume_from_checkpoint=...) (engine.load)"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("add parameters to the model before ZeroTrainer builds the engine")


class AcceleratedEngineOptimizer(AcceleratedOptimizer):
    """Accelerate's wrapper over an :class:`EngineOptimizer`: no device placement (which
    would round-trip a state dict) and no loss scaler; ``step_was_skipped`` is the
    engine's (a step skipped for a non-finite gradient), so the Trainer does not advance
    its scheduler past a step that was not applied, as the engine's own scheduler does."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)

    @property
    def step_was_skipped(self) -> bool:
        return not self.optimizer.last_step_applied
