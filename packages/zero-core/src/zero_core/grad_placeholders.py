"""``p.grad`` between ``engine.backward`` and ``engine.step``: a placeholder that raises.

The engine's gradients are not on ``p.grad``. They are reduced into its own buffers (at
stages 2 and 3 only this rank's slice exists), summed over ranks, micro-steps and the
loss scale, and divided at the step. Code that reads ``p.grad`` there would compute on
the wrong values without a word: ``torch.nn.utils.clip_grad_norm_(model.parameters())``
saw ``None`` everywhere and returned 0 having clipped nothing; at stages 0 and 1 it saw
the undivided sum. So from the end of ``engine.backward`` until the step (or
``zero_grad``) every trainable parameter's ``.grad`` is a :class:`GradPlaceholder`: a
tensor of the parameter's shape, dtype and device, with no storage, that raises on any
operation, naming what to call instead:

    engine.backward(loss)      p.grad = GradPlaceholder  (clip_grad_norm_, p.grad.norm(),
    ...                                                   an optimizer's step, a second
    engine.step()              p.grad = None              loss.backward(): RuntimeError)

``p.grad is not None`` stays true, as code that skips parameters without a gradient
expects; only using the value raises.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

MESSAGE = (
    "p.grad of a parameter trained by zero_core is a placeholder between engine.backward() "
    "and engine.step(): the reduced gradients live in the engine's buffers (only this "
    "rank's slice at stages 2 and 3). To clip, call engine.clip_grad_norm_(max_norm) (or "
    "set ZeroConfig(clip_grad_norm=...)); the last norm is engine.last_grad_norm; call "
    "engine.backward(loss), not loss.backward(), and engine.step(), not optimizer.step()"
)


class GradPlaceholder(torch.Tensor):
    """A storage-less tensor shaped like a parameter whose every operation raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> GradPlaceholder:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(f"{MESSAGE} (operation: {func})")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype}): {MESSAGE}"


def is_placeholder(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, GradPlaceholder)


def place(params: Iterable[nn.Parameter]) -> None:
    """Put a placeholder on every parameter's ``.grad`` (after engine.backward)."""
    for p in params:
        p.grad = GradPlaceholder(p)


def remove(params: Iterable[nn.Parameter]) -> None:
    """``.grad = None`` where a placeholder is (before backward, at the step, on close)."""
    for p in params:
        if isinstance(p.grad, GradPlaceholder):
            p.grad = None
