"""Which engine trains a parameter, and whether it is partitioned (ZeRO-3).

Code written for DeepSpeed tests ``hasattr(p, "ds_id")`` to learn that a parameter is
partitioned and must be gathered before its values are read; with no such test it reads
a shard (or an empty tensor) as if it were the whole value. :func:`is_partitioned` is
that test for zero_core, and works on any tensor:

    if zero_core.is_partitioned(p):
        with engine.gathered_parameters([p]):
            value = p.detach().clone()      # whole, on every rank, inside the block

The registry holds parameters and engines weakly: once an engine is gone, its
parameters are no longer reported as partitioned.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .stage_policy import ParameterPlacement

if TYPE_CHECKING:
    from .engine import Engine

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(engine: Engine) -> None:
    """Record ``engine`` as the owner of each parameter it trains."""
    ref = weakref.ref(engine)
    for slot in engine.slots:
        _OWNERS[slot.param] = ref


def unregister(engine: Engine) -> None:
    """Forget ``engine``'s parameters (it is closed)."""
    for slot in engine.slots:
        _OWNERS.pop(slot.param, None)  # type: ignore[no-untyped-call]


def any_owned() -> bool:
    """Whether any live engine's parameters are recorded (a fast path for module_guard)."""
    return len(_OWNERS) > 0


def owner(param: torch.Tensor) -> Engine | None:
    """The live engine that trains ``param``, or None."""
    ref = _OWNERS.get(param)  # type: ignore[no-untyped-call]
    return None if ref is None else ref()


def is_partitioned(param: torch.Tensor) -> bool:
    """True when ``param`` is trained by a live engine that shards parameters (stage 3):
    outside ``engine.gathered_parameters`` (and forward/backward) it holds only this
    rank's shard, so its whole value must be gathered to be read."""
    engine = owner(param)
    return engine is not None and engine.policy.parameters is ParameterPlacement.SHARDED
