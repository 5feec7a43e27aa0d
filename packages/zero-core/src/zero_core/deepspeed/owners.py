"""Which engine owns a parameter: what ``zero.GatheredParameters`` and ``utils.safe_get_*``
need, since DeepSpeed's versions take parameters alone.

``initialize`` records every trainable parameter of the engine it builds. Entries hold
weak references (a dropped engine or model is not kept alive) and are looked up by the
parameter's identity: a ``WeakKeyDictionary`` would compare tensors with ``==``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn

from ..engine import Engine

_Entry = tuple["weakref.ref[nn.Parameter]", "weakref.ref[Engine]"]


class ParameterOwners:
    """Parameter -> the core Engine that trains it."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def record(self, engine: Engine) -> None:
        """Every trainable parameter of ``engine`` is owned by it from now on."""
        self._drop_dead()
        for slot in engine.slots:
            self._entries[id(slot.param)] = (weakref.ref(slot.param), weakref.ref(engine))

    def owner(self, param: nn.Parameter) -> Engine | None:
        """The live engine that trains ``param``, or None (a parameter no facade engine
        owns: frozen, or of a model never passed to initialize)."""
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]()

    def by_owner(self, params: Iterable[nn.Parameter]) -> list[tuple[Engine, list[nn.Parameter]]]:
        """``params`` grouped by owning engine, engines and parameters in first-seen order;
        parameters no engine owns are left out."""
        groups: dict[int, tuple[Engine, list[nn.Parameter]]] = {}
        for p in params:
            engine = self.owner(p)
            if engine is not None:
                groups.setdefault(id(engine), (engine, []))[1].append(p)
        return list(groups.values())

    def _drop_dead(self) -> None:
        dead = [key for key, (p, e) in self._entries.items() if p() is None or e() is None]
        for key in dead:
            del self._entries[key]


OWNERS = ParameterOwners()
