"""What the engine does to the inputs of forward before the module sees them."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


def cast_floating(value: T, dtype: torch.dtype) -> T:
    """``value`` with every floating-point tensor in it cast to ``dtype``; tuples (named
    ones too), lists and dicts are rebuilt around the cast tensors, anything else (integer
    token ids, masks, strings) is passed through untouched."""
    result: Any = value
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype:
            result = value.to(dtype)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        result = type(value)(*(cast_floating(v, dtype) for v in value))
    elif isinstance(value, tuple | list):
        result = type(value)(cast_floating(v, dtype) for v in value)
    elif isinstance(value, dict):
        result = {k: cast_floating(v, dtype) for k, v in value.items()}
    return result  # type: ignore[no-any-return]
