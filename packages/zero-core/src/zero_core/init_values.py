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
    for name, target, box in init_value_boxes(module, values):
        yield name, target, box.pop()


def init_value_boxes(
    module: nn.Module, values: InitValues
) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """:func:`named_init_values`, each value in a one-element list that the caller empties
    (``box.pop()``): this generator keeps no reference to a value it has handed on, so a
    value of ``values``' own generator is freed as soon as its caller drops it, before
    the next one is made (a suspended generator's local would hold it until then)."""
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
        box = [value]
        del value
        yield name, target, box
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


def values_from_reset_parameters(
    module: nn.Module, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Initial values for a model built on the meta device, made by each submodule's own
    ``reset_parameters()``, one submodule at a time: FSDP2's ``model.to_empty(device=...)``
    then ``reset_parameters()``, without ever materialising the whole model.

        with torch.device("meta"):
            model = Transformer(args)
        engine = zero_core.initialize(
            model, optimizer, config, comm,
            init_values=zero_core.values_from_reset_parameters(model),
        )

    For each submodule holding meta tensors of its own, a copy of that submodule alone
    (its children stay on the meta device) is made real on ``device``, filled with NaN,
    and its ``reset_parameters()`` (or ``_reset_parameters()``, as torch's
    MultiheadAttention names it) is called; its own parameters and floating buffers are
    then yielded by their names in ``module``. Raises ValueError naming the submodule when
    it has no ``reset_parameters``, when a value is still NaN after it (nothing set it: a
    buffer computed in ``__init__`` is lost on the meta device), or when an integer buffer
    is on the meta device: give those through ``init_values`` as a state dict instead."""
    import copy

    for prefix, sub in module.named_modules(remove_duplicate=True):
        own = [
            *(("param", n, t) for n, t in sub.named_parameters(recurse=False)),
            *(("buffer", n, t) for n, t in sub.named_buffers(recurse=False)),
        ]
        meta = [(kind, n, t) for kind, n, t in own if t.is_meta]
        if not meta:
            continue
        where = prefix or type(module).__name__
        # torch's MultiheadAttention (and other modules) name it _reset_parameters
        reset_name = next(
            (
                n
                for n in ("reset_parameters", "_reset_parameters")
                if callable(getattr(sub, n, None))
            ),
            None,
        )
        if reset_name is None:
            raise ValueError(
                f"{where} ({type(sub).__name__}) has {meta[0][1]} on the meta device and no "
                "reset_parameters() to initialise it: add one, or pass its values with "
                "init_values= (a state dict or (name, tensor) pairs)"
            )
        for kind, name, tensor in meta:
            if not tensor.is_floating_point():
                raise ValueError(
                    f"{where}.{name} is a {tensor.dtype} {kind} on the meta device: "
                    "reset_parameters() cannot be checked to set it; pass it with init_values="
                )
        real = copy.deepcopy(sub).to_empty(device=device, recurse=False)
        with torch.no_grad():
            for t in (*real.parameters(recurse=False), *real.buffers(recurse=False)):
                t.fill_(float("nan"))
            getattr(real, reset_name)()
        values = dict(real.named_parameters(recurse=False))
        values.update(real.named_buffers(recurse=False))
        for _, name, _ in meta:
            value = values[name].detach()
            if torch.isnan(value).any():
                raise ValueError(
                    f"{where}.{name} is still unset after {type(sub).__name__}."
                    f"{reset_name}(): it does not initialise it (a buffer computed in "
                    "__init__ is lost on the meta device); pass it with init_values="
                )
            yield (f"{prefix}.{name}" if prefix else name), value
