"""The Hugging Face Trainer through zero_core: ``ZeroTrainer``, a ``transformers.Trainer``.

    from zero_core import ZeroConfig
    from zero_core.huggingface import ZeroTrainer

    trainer = ZeroTrainer(model, TrainingArguments(...), zero_config=ZeroConfig(stage=3),
                          train_dataset=data)
    trainer.train()

Launch it as the Trainer is launched (``torchrun --nproc-per-node N``, ``zero-launch -n
N``). It needs the extra ``zero-core[huggingface]``: ``transformers`` and ``accelerate`` at
the versions it is tested with (TESTED_VERSIONS; zero_core never imports this package by
itself). docs/huggingface-trainer.md says what it supports and refuses.

Importing it also guards ``accelerate.Accelerator.prepare_model``: a model a zero_core engine
trains is refused there, naming ZeroTrainer (zero_core.accelerate_guard).
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as missing:
    raise ImportError(
        f"zero_core.huggingface needs transformers and accelerate ({missing}): "
        "pip install 'zero-core[huggingface]'"
    ) from None

from ..accelerate_guard import install as _install_accelerate_guard
from .accelerator import ZeroAccelerator
from .optimizer import EngineOptimizer
from .trainer import TESTED_VERSIONS, ZeroTrainer

_install_accelerate_guard()

__all__ = ["TESTED_VERSIONS", "EngineOptimizer", "ZeroAccelerator", "ZeroTrainer"]
