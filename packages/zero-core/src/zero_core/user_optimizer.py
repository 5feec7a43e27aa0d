"""The optimizer object the user built before ``initialize``: it drives the engine, or raises.

The engine steps an optimizer of its own, built over its float32 master weights. The one
the user passed would otherwise live on beside it, and two habits went wrong silently:

- a learning-rate scheduler built on it (DeepSpeed-Chat builds ``get_scheduler(optimizer)``
  before ``deepspeed.initialize``) changed a learning rate the engine never read;
- its own ``optimizer.step()`` (an FSDP loop's) moved the module's parameters with each
  rank's unreduced gradient.

:func:`link` makes that object a front for ``engine.optimizer``:

    user optimizer                       engine.optimizer
      .param_groups  ------- same list ---->  [{"params": [master tiles], "lr": ...}, ...]
      .step()            raises: call engine.step()
      .zero_grad()       nothing to do at a step boundary (the engine dropped them);
                         raises between engine.backward and engine.step
      .state_dict() / .load_state_dict() / .add_param_group()
                         raise: the state is engine.optimizer's (engine.save / load)

So a scheduler built on it, before or after ``initialize``, sets the learning rate the
engine steps with (the group options a scheduler added, such as ``initial_lr``, are carried
over), and nothing that would train wrongly can run.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine import Engine

MARK = "_zero_core_linked"


def link(user: torch.optim.Optimizer, engine: Engine) -> None:
    """Make ``user`` (the optimizer given to initialize) a front for ``engine.optimizer``."""
    own = engine.optimizer
    if user is own:
        return
    for theirs, ours in zip(user.param_groups, own.param_groups, strict=True):
        for key, value in theirs.items():
            if key != "params" and key not in ours:
                ours[key] = value  # what a scheduler built before initialize added
    user.param_groups = own.param_groups
    # torch's schedulers warn "lr_scheduler.step() before optimizer.step()" unless the
    # optimizer they hold was stepped; engine.step() steps it now.
    user._opt_called = True  # type: ignore[attr-defined]
    engine_ref = weakref.ref(engine)

    # Plain functions in the instance's dict, not bound methods: a bound method there
    # would make an optimizer -> method -> optimizer cycle that only gc frees.
    def step(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "this optimizer was given to zero_core.initialize: the engine steps its own "
            "optimizer (engine.optimizer) over the master weights, with the reduced "
            "gradients. Call engine.step() instead of optimizer.step(); learning-rate "
            "schedulers built on this optimizer already drive engine.optimizer"
        )

    def zero_grad(set_to_none: bool = True) -> None:
        engine = engine_ref()
        if engine is not None and engine.micro_steps:
            raise RuntimeError(
                f"optimizer.zero_grad() after {engine.micro_steps} engine.backward calls "
                "without engine.step(): it would drop the accumulated gradients. The engine "
                "drops them after every applied step: call engine.step() first"
            )

    def refused(name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"optimizer.{name}() on the optimizer given to zero_core.initialize: its "
                "state lives in engine.optimizer, over this rank's master weights. Save and "
                "restore with engine.save(path) / engine.load(path)"
                + ("; add parameters before initialize" if name == "add_param_group" else "")
            )

        return method

    # Schedulers wrap optimizer.step to see that it ran, and warn when it was replaced
    # after them; the engine's step is what runs, so this one counts as wrapped.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    user.step = step  # type: ignore[method-assign,assignment]
    user.zero_grad = zero_grad  # type: ignore[method-assign]
    for name in ("state_dict", "load_state_dict", "add_param_group"):
        setattr(user, name, refused(name))
    setattr(user, MARK, True)


def is_linked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` was given to an engine (and now fronts its optimizer)."""
    return bool(getattr(optimizer, MARK, False))
