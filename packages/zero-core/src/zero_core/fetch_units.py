"""Stage 3's fetch units: which parameters are gathered together, and for which module.

Pure bookkeeping over a module tree: no tensor is allocated or moved here.

A *unit* is the trainable parameters registered directly on one module (``recurse=False``)
that no earlier module registered: a tied weight belongs to the first module that holds it,
and every module that holds it needs that unit. Trainable parameters of at most
``persistence_threshold`` elements form one more unit, the persistent one, which is never
released. Frozen parameters belong to no unit: they stay whole on every rank.

    GPT (tied head):  unit 0  wte                 needed by wte and lm_head
                      unit 1  wpe                 needed by wpe
                      unit 2  blocks.0.attn.qkv   needed by blocks.0.attn.qkv
                      ...
                      unit K  (persistent)        every bias and LayerNorm weight

Units are numbered in module registration order, which is also the order their gradient
buckets are reduced in, last unit first (see grad_reducer).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .param_table import ParamTable

PERSISTENT = "(persistent parameters)"


@dataclass(frozen=True)
class UnitPlan:
    """The units of one model.

    names: each unit's label (the module's qualified name; "(root)" for the model itself,
        PERSISTENT for the persistent unit, which is last when it exists).
    slot_units: the unit of each trainable parameter, by slot index (param_table).
    module_units: every module that needs a non-persistent unit, with those units.
    """

    names: tuple[str, ...]
    slot_units: tuple[int, ...]
    module_units: tuple[tuple[nn.Module, tuple[int, ...]], ...]
    persistent: int | None

    @property
    def count(self) -> int:
        return len(self.names)


def plan_units(module: nn.Module, slots: ParamTable, persistence_threshold: int) -> UnitPlan:
    """Units of ``module`` for its trainable parameters (``slots``)."""
    names: list[str] = []
    slot_units: list[int | None] = [None] * len(slots)
    persistent_slots: list[int] = []
    module_units: list[tuple[nn.Module, tuple[int, ...]]] = []
    for name, sub in module.named_modules():
        own: int | None = None  # the unit of parameters first registered on ``sub``
        needs: list[int] = []
        for p in sub._parameters.values():
            slot = None if p is None else slots.get(p)
            if slot is None:
                continue
            if slot_units[slot.index] is None:
                if slot.numel <= persistence_threshold:
                    persistent_slots.append(slot.index)
                    slot_units[slot.index] = -1  # numbered once every other unit is
                    continue
                if own is None:
                    names.append(name or "(root)")
                    own = len(names) - 1
                slot_units[slot.index] = own
            unit = slot_units[slot.index]
            assert unit is not None
            if unit >= 0 and unit not in needs:
                needs.append(unit)
        if needs:
            module_units.append((sub, tuple(needs)))
    persistent = None
    if persistent_slots:
        persistent = len(names)
        names.append(PERSISTENT)
        for index in persistent_slots:
            slot_units[index] = persistent
    assert all(unit is not None for unit in slot_units), "every slot is a parameter of module"
    units = tuple(unit for unit in slot_units if unit is not None)
    return UnitPlan(tuple(names), units, tuple(module_units), persistent)
