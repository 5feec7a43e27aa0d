"""After ``initialize``, module calls that would detach or misread the trained parameters raise.

``module.to(...)``, ``.to_empty(...)``, ``.half()``, ``.cuda()`` run ``nn.Module._apply``,
which replaces each parameter's tensor with a converted copy. The engine's parameters are
views of its buffers (stages 0-2) or shards it gathers into (stage 3), so after such a call
the engine would go on training tensors the module no longer uses, without a word. FSDP2
users do exactly that by habit: ``fully_shard(model)``, then ``model.to_empty(device=...)``
and ``reset_parameters()``.

:func:`install` (called by ``initialize``) wraps ``nn.Module._apply`` once per process so
that it checks each result: a conversion that returns the same tensor (``.to()`` to the
device and dtype it already has) passes; one that would replace a parameter a live engine
trains (param_owner) raises, naming what to do instead. Modules no engine trains, and
the parameters of a closed engine, convert as before; with no live engine the wrapper
only checks an empty registry. (Per-module ``_apply`` attributes were tried first: each
made a module -> bound method -> module cycle, which only the garbage collector frees.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import state_dict_reads
from .param_owner import any_owned, is_partitioned, owner

MESSAGE = (
    "module.{what}() after zero_core.initialize would replace parameter {name}: the engine "
    "trains its own views or shards of it and would go on training tensors the module no "
    "longer uses. Move or convert the model before initialize; for a model built on the "
    "meta device, pass init_values=zero_core.values_from_reset_parameters(model) to "
    "initialize (FSDP2's to_empty + reset_parameters, one module at a time)"
)


# torch's own, also if this module is imported again after install()
_PLAIN_APPLY = getattr(nn.Module._apply, "plain_apply", nn.Module._apply)


def _guarded_apply(
    self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> Any:
    if not any_owned():
        return _PLAIN_APPLY(self, fn, recurse)

    def checked(tensor: torch.Tensor) -> torch.Tensor:
        out = fn(tensor)
        if out is not tensor and isinstance(tensor, nn.Parameter) and owner(tensor) is not None:
            # fn is torch's local function of the method called: Module.to_empty.<locals>...
            parts = getattr(fn, "__qualname__", "to").split(".")
            what = parts[1] if len(parts) > 1 and parts[0] == "Module" else "to"
            name = next(
                (n for n, p in self.named_parameters(remove_duplicate=False) if p is tensor), "?"
            )
            raise RuntimeError(MESSAGE.format(what=what, name=name))
        return out

    return _PLAIN_APPLY(self, checked, recurse)


_guarded_apply.plain_apply = _PLAIN_APPLY  # type: ignore[attr-defined]


def install() -> None:
    """Make every module refuse conversions that replace parameters a live engine trains
    (idempotent)."""
    nn.Module._apply = _guarded_apply  # type: ignore[method-assign]


def is_released(param: torch.Tensor) -> bool:
    """Whether a stage-3 parameter is released: its whole value is not held here, only a
    one-element NaN placeholder expanded to its shape (param_gatherer)."""
    if param.numel() == 0:
        return False
    return param.untyped_storage().nbytes() < param.numel() * param.element_size() or (
        param.numel() == 1 and bool(torch.isnan(param).any())
    )


STATE_DICT_MESSAGE = (
    "{module}.state_dict() at stage 3 outside engine.gathered_parameters(): parameter "
    "{name} is partitioned (this rank holds a shard; the module's tensor reads NaN), so "
    "the state dict would be NaN. Use engine.full_state_dict(rank=0) (float32, "
    "consolidated), or call state_dict() inside `with engine.gathered_parameters():`"
)


def guard_state_dict(module: nn.Module) -> None:
    """At stage 3, make ``state_dict()`` of ``module`` or any submodule raise while a
    parameter it holds is released (a saved model.state_dict() was NaN, exit 0: the trap
    DeepSpeed-aware export code fell into)."""

    def refuse_released(sub: nn.Module, prefix: str, keep_vars: bool) -> None:
        if state_dict_reads.by_engine():
            return
        for name, p in sub.named_parameters(recurse=False):
            if is_partitioned(p) and is_released(p):
                where = prefix.rstrip(".") or type(sub).__name__
                raise RuntimeError(STATE_DICT_MESSAGE.format(module=where, name=prefix + name))

    for sub in module.modules():
        if any(True for _ in sub.parameters(recurse=False)):
            sub.register_state_dict_pre_hook(refuse_released)  # type: ignore[no-untyped-call]
