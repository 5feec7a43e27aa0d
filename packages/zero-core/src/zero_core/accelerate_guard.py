"""``accelerator.prepare(model)`` of a model a zero_core engine trains raises, naming the path.

Accelerate has no plugin hook: ``Accelerator.prepare_model`` wraps any module with trainable
parameters in ``DistributedDataParallel`` when more than one process runs. For a module a
live engine trains that is a silent double reduction at stages 0-2 (DDP all-reduces
``.grad``, then the engine reduces again) and, at stage 3, DDP over the NaN placeholders the
released parameters hold. So :func:`install` wraps ``accelerate.Accelerator.prepare_model``
once per process (as module_guard wraps ``nn.Module._apply``): a module holding a parameter
that a live engine trains (param_owner) is refused with one error naming the supported
paths; every other module is prepared as before, and with no live engine the wrapper only
checks an empty registry.

``zero_core.initialize`` installs it when ``accelerate`` is already imported (the usual
order: the ``Accelerator`` is made before the model), and ``zero_core.huggingface`` installs
it on import. This module imports ``accelerate`` only inside :func:`install`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from .param_owner import any_owned, owner

MESSAGE = (
    "accelerator.prepare({kind}): {name} is trained by a zero_core engine (stage {stage}), "
    "which reduces its gradients and steps its optimizer itself; Accelerate would wrap it in "
    "DistributedDataParallel and reduce them a second time. With the Hugging Face Trainer use "
    "zero_core.huggingface.ZeroTrainer(model, args, zero_config=...) instead of Trainer; in "
    "your own Accelerate loop prepare only the data loaders and train with engine(batch), "
    "engine.backward(loss), engine.step()"
)
GUARD_MARK = "zero_core_guard"


def refuse_engine_managed(model: Any, kind: str = "model") -> None:
    """Raise ValueError if ``model`` (an ``nn.Module``) holds a parameter a live engine
    trains; anything else passes."""
    if not isinstance(model, nn.Module) or not any_owned():
        return
    for name, p in model.named_parameters():
        engine = owner(p)
        if engine is not None:
            raise ValueError(
                MESSAGE.format(
                    kind=kind,
                    name=f"{type(model).__name__} (parameter {name})",
                    stage=engine.config.stage,
                )
            )


def install() -> None:
    """Wrap ``accelerate.Accelerator.prepare_model`` (idempotent)."""
    import accelerate

    plain = accelerate.Accelerator.prepare_model
    if getattr(plain, GUARD_MARK, False):
        return

    @functools.wraps(plain)
    def prepare_model(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        refuse_engine_managed(model)
        return plain(self, model, *args, **kwargs)

    setattr(prepare_model, GUARD_MARK, True)
    accelerate.Accelerator.prepare_model = prepare_model


def install_if_imported() -> None:
    """:func:`install` if the process has imported ``accelerate`` (never imports it)."""
    if "accelerate" in sys.modules:
        install()
