"""What the user gave as an optimizer, turned into parameter groups and a builder.

Accepted, as DeepSpeed and FSDP users expect:

    torch.optim.AdamW(model.parameters(), lr=1e-3)     an instance: its groups and options
    torch.optim.AdamW  (+ optimizer_kwargs)             a class: one group of all trainables
    lambda params: torch.optim.AdamW(params, lr=1e-3)   a factory of an instance

The engine then builds the same optimizer class, with the same per-group options, over its
own float32 master tensors (the full ones at stage 0, this rank's shard otherwise). Only
elementwise optimizers are correct on a shard (SGD, Adam, AdamW, Adagrad, RMSprop, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .param_table import ParamNames

OptimizerSpec = torch.optim.Optimizer | type[torch.optim.Optimizer] | Callable[..., Any]

# Optimizers whose update of an element depends on that element's history alone, so a
# shard gets the same bits as the whole tensor. Others (Adafactor, LBFGS, ...) are refused
# unless ZeroConfig(allow_untested_optimizer=True).
ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
)  # fmt: skip


@dataclass(frozen=True)
class ParamGroups:
    """The trainable parameters in optimizer groups, and how to rebuild the optimizer."""

    params: tuple[tuple[nn.Parameter, ...], ...]
    options: tuple[dict[str, Any], ...]
    optimizer_class: type[torch.optim.Optimizer]
    defaults: dict[str, Any]

    def build(self, tensors: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        """The optimizer over ``tensors`` (a list per group), with each group's options."""
        groups = [
            {"params": list(ts), **opts} for ts, opts in zip(tensors, self.options, strict=True)
        ]
        # Each group carries every option; the constructor takes the defaults it names
        # (some optimizers keep defaults their constructor does not accept).
        accepted = inspect.signature(self.optimizer_class.__init__).parameters
        defaults = {k: v for k, v in self.defaults.items() if k in accepted}
        return self.optimizer_class(groups, **defaults)


def resolve_param_groups(
    model: nn.Module,
    optimizer: OptimizerSpec,
    optimizer_kwargs: Mapping[str, Any] | None,
    *,
    allow_untested: bool = False,
) -> ParamGroups:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (every requires_grad is "
            "False): unfreeze the parameters to train, or run the model without ZeRO"
        )
    instance: Any
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        instance = optimizer(trainable, **(optimizer_kwargs or {}))
    elif isinstance(optimizer, torch.optim.Optimizer):
        if getattr(optimizer, "_zero_core_linked", False):  # user_optimizer.MARK
            raise ValueError(
                "this optimizer was already given to zero_core.initialize and now fronts "
                "that engine's optimizer; build a new one over model.parameters()"
            )
        if optimizer_kwargs:
            raise TypeError("optimizer_kwargs apply to an optimizer class, not to an instance")
        instance = optimizer
    elif callable(optimizer):
        factory: Callable[..., Any] = optimizer
        instance = factory(trainable, **(optimizer_kwargs or {}))
        if not isinstance(instance, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(instance)}, not an Optimizer")
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, its class, or a factory; got {optimizer!r}"
        )
    if type(instance) not in ELEMENTWISE and not allow_untested:
        raise TypeError(
            f"{type(instance).__name__} is not a known elementwise optimizer, so its update on "
            "a shard may differ from the update on the whole tensor; use one of "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)}, or set "
            "ZeroConfig(allow_untested_optimizer=True) if you know it is elementwise"
        )
    names = ParamNames(model)
    seen: set[str] = set()
    params, options = [], []
    for index, group in enumerate(instance.param_groups):
        members = []
        for p in group["params"]:
            name = names.name(p)
            if name is None:
                raise ValueError(
                    f"optimizer group {index} holds a parameter of shape {tuple(p.shape)} that "
                    "is not in the model; build the optimizer from model.parameters()"
                )
            if not p.requires_grad:
                raise ValueError(
                    f"parameter {name} has requires_grad=False but is in optimizer "
                    f"group {index}; remove frozen parameters from the optimizer"
                )
            seen.add(name)
            members.append(p)
        params.append(tuple(members))
        options.append({k: v for k, v in group.items() if k != "params"})
    missing = [name for p in trainable if (name := names.name(p) or "?") not in seen]
    if missing:
        raise ValueError(
            f"trainable parameters {missing[:5]} are in no optimizer group; add them or set "
            "requires_grad=False"
        )
    # Some optimizers (Adagrad) create state at construction; only stepped state is lost.
    # Adagrad builds state with step 0 at construction; any other state means it has stepped.
    if any(float(s.get("step", 1)) > 0 for s in instance.state.values() if s):
        raise ValueError(
            "the optimizer has already taken steps; its state would be dropped. Pass a fresh "
            "optimizer (load a checkpoint to resume)"
        )
    return ParamGroups(tuple(params), tuple(options), type(instance), dict(instance.defaults))
