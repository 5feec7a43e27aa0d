"""Lightning's own checkpoint contents (loops, callbacks, schedulers, hyper-parameters),
kept inside the engine's sharded checkpoint.

``trainer.save_checkpoint(path)`` hands the strategy one dict. The model and optimizer
states in it are the engine's to save (sharded, any world size on load); the rest is
Lightning's, and may hold any picklable object (``save_hyperparameters`` keeps whatever
the module was given). It travels as pickled bytes in the checkpoint's ``extra``, so it
comes back exactly as Lightning gave it; only this library's own checkpoints are read
back this way (``weights_only=False``, as Lightning loads its own ``.ckpt`` files).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import torch

# The keys of Lightning's checkpoint dict that the engine's own state replaces.
ENGINE_KEYS = ("state_dict", "optimizer_states")
# Where Lightning's state lives in the engine checkpoint's ``extra``.
EXTRA_KEY = "lightning_checkpoint_pickle_base64"


def to_extra(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict without the engine's keys, as JSON-safe ``extra``."""
    kept = {k: v for k, v in checkpoint.items() if k not in ENGINE_KEYS}
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    return {EXTRA_KEY: base64.b64encode(buffer.getvalue()).decode("ascii")}


def from_extra(extra: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The dict :func:`to_extra` kept, with empty engine keys (the engine has loaded
    them); ValueError naming ``path`` where the checkpoint was not written by
    ZeroStrategy."""
    if EXTRA_KEY not in extra:
        raise ValueError(
            f"{path} is a zero_core checkpoint without Lightning's state (saved by "
            "engine.save, not trainer.save_checkpoint under ZeroStrategy): load it with "
            "strategy.engine.load(path) in on_fit_start instead of ckpt_path="
        )
    state = torch.load(io.BytesIO(base64.b64decode(extra[EXTRA_KEY])), weights_only=False)
    return {**state, "state_dict": {}, "optimizer_states": []}
