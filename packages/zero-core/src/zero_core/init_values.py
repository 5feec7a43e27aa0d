"""Initial values given by name, streamed one tensor at a time (``initialize(init_values=)``).

A model may be built on the meta device (no memory) and its values supplied as
``(name, tensor)`` pairs: a generator that makes one parameter at a time (``GPT.
initial_values(seed)``), or a state dict. Stage 3 shards each value as it arrives, so no
rank ever holds the whole model; stages 0-2 materialise it (they hold it whole anyway).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

InitValues = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


def named_init_values(
    module: nn.Module, values: InitValues
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield (name, parameter or buffer of ``module``, value) for each given value.

    Names are those of ``module.named_parameters()`` / ``named_buffers()`` (a tied
    weight's second name is accepted and skipped). Raises ValueError for an unknown name,
    a shape that differs from the module's, and, once the values run out, any parameter or
    buffer still on the meta device (nothing gave it a value)."""
    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    targets.update(module.named_buffers(remove_duplicate=False))
    seen: set[int] = set()
    items = values.items() if isinstance(values, Mapping) else values
    for name, value in items:
        target = targets.get(name)
        if target is None:
            close = ", ".join(list(targets)[:5])
            raise ValueError(
                f"init_values has {name!r}, which is not a parameter or buffer of "
                f"{type(module).__name__} (those are named like {close}, ...)"
            )
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"init_values[{name!r}] has shape {tuple(value.shape)} but the model's "
                f"{name} is {tuple(target.shape)}: the values are for another model or size"
            )
        if id(target) in seen:
            continue
        seen.add(id(target))
        yield name, target, value
    missing = [name for name, t in targets.items() if t.is_meta and id(t) not in seen]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters or buffers are on the meta device and init_values "
            f"gave them no value: {', '.join(missing[:5])}"
        )


def materialise(tensor: torch.Tensor, value: torch.Tensor, device: torch.device) -> None:
    """Give ``tensor`` (a parameter or buffer, maybe on the meta device) a copy of
    ``value`` in its own dtype on ``device``, keeping the Python object (optimizers
    refer to it)."""
    if tensor.is_meta:
        real = value.detach().to(device, tensor.dtype, copy=True)
        replacement = (
            nn.Parameter(real, requires_grad=tensor.requires_grad)
            if isinstance(tensor, nn.Parameter)
            else real
        )
        torch.utils.swap_tensors(tensor, replacement)  # type: ignore[no-untyped-call]
    else:
        with torch.no_grad():
            tensor.copy_(value)


def become(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``tensor`` hold ``data`` (``tensor.data = data``, also from the meta device)."""
    if tensor.is_meta and not data.is_meta:
        torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
            tensor,
            nn.Parameter(data, requires_grad=tensor.requires_grad)
            if isinstance(tensor, nn.Parameter)
            else data,
        )
    else:
        tensor.data = data
