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

PERSISTENT = "(persistent parameters)"


@dataclass(frozen=True)
class UnitPlan:
    """The units of one model.

    names: each unit's label (the module's qualified name; "(root)" for the model itself,
        PERSISTENT for the persistent unit, which is last when it exists).
    param_unit: id(parameter) -> its unit, for every trainable parameter.
    module_units: id(module) -> the non-persistent units it needs, for every module that
        needs one.
    """

    names: tuple[str, ...]
    param_unit: dict[int, int]
    module_units: dict[int, tuple[int, ...]]
    persistent: int | None

    @property
    def count(self) -> int:
        return len(self.names)


def plan_units(module: nn.Module, trainable: set[int], persistence_threshold: int) -> UnitPlan:
    """Units of ``module`` for the parameters whose ids are in ``trainable``."""
    names: list[str] = []
    param_unit: dict[int, int] = {}
    persistent_params: list[int] = []
    needs: dict[int, list[int]] = {}
    for name, sub in module.named_modules():
        own: int | None = None  # the unit of parameters first registered on ``sub``
        for p in sub._parameters.values():
            if p is None or id(p) not in trainable:
                continue
            if id(p) not in param_unit:
                if p.numel() <= persistence_threshold:
                    persistent_params.append(id(p))
                    param_unit[id(p)] = -1  # numbered once every other unit is
                    continue
                if own is None:
                    names.append(name or "(root)")
                    own = len(names) - 1
                param_unit[id(p)] = own
            unit = param_unit[id(p)]
            if unit >= 0 and unit not in needs.setdefault(id(sub), []):
                needs[id(sub)].append(unit)
    persistent = None
    if persistent_params:
        persistent = len(names)
        names.append(PERSISTENT)
        for key in persistent_params:
            param_unit[key] = persistent
    module_units = {key: tuple(units) for key, units in needs.items() if units}
    return UnitPlan(tuple(names), param_unit, module_units, persistent)
