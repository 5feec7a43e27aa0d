"""Which engine trains a parameter, and whether it is partitioned (ZeRO-3).

Code written for DeepSpeed tests ``hasattr(p, "ds_id")`` to learn that a parameter is
partitioned and must be gathered before its values are read; with no such test it reads
a shard (or an empty tensor) as if it were the whole value. :func:`is_partitioned` is
that test for zero_core, and works on any tensor:

    if zero_core.is_partitioned(p):
        with engine.gathered_parameters([p]):
            value = p.detach().clone()      # whole, on every rank, inside the block

The registry holds parameters and engines weakly: once an engine is closed or gone, its
parameters are no longer reported as partitioned.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
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


def any_owned() -> bool:
    """Whether any live engine's parameters are recorded (a fast path for module_guard)."""
    return len(_OWNERS) > 0


def owner(param: torch.Tensor) -> Engine | None:
    """The live engine that trains ``param``, or None."""
    ref = _OWNERS.get(param)  # type: ignore[no-untyped-call]
    engine = None if ref is None else ref()
    return None if engine is None or engine.closed else engine


def by_owner(params: Iterable[nn.Parameter]) -> list[tuple[Engine, list[nn.Parameter]]]:
    """``params`` grouped by their live engine, engines and parameters in first-seen
    order; parameters no live engine trains are left out."""
    groups: dict[int, tuple[Engine, list[nn.Parameter]]] = {}
    for p in params:
        engine = owner(p)
        if engine is not None:
            groups.setdefault(id(engine), (engine, []))[1].append(p)
    return list(groups.values())


def is_partitioned(param: torch.Tensor) -> bool:
    """True when ``param`` is trained by a live engine that shards parameters (stage 3):
    outside ``engine.gathered_parameters`` (and forward/backward) it holds only this
    rank's shard, so its whole value must be gathered to be read."""
    engine = owner(param)
    return engine is not None and engine.policy.parameters is ParameterPlacement.SHARDED
