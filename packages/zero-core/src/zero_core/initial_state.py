"""Rank 0's initial values on every rank, one trainable parameter at a time.

Each trainable parameter's value (the module's own, or ``init_values``') is broadcast from
rank 0 as a whole float32 tensor and handed to the engine's components, which keep what
their placement needs (the whole value in a bucket, or this rank's slice); then the frozen
parameters and buffers are broadcast whole and cast to the compute dtype. At no point
does a rank hold more than one whole trainable parameter beyond what it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from zero_comm import Communicator

from .init_values import InitValues, materialise, named_init_values
from .param_table import ParamSlot, ParamTable


def whole_tensors(module: nn.Module, slots: ParamTable) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers by state-dict name: what every rank holds whole at
    every stage (the trainable parameters are the engine's to lay out)."""
    out: dict[str, torch.Tensor] = {
        name: p for name, p in module.named_parameters() if slots.get(p) is None
    }
    out.update(module.named_buffers())
    return out


def take_initial_state(
    module: nn.Module,
    slots: ParamTable,
    init_values: InitValues | None,
    comm: Communicator,
    dtype: torch.dtype,
    keep: Callable[[ParamSlot, torch.Tensor], None],
) -> None:
    """Collective: call ``keep(slot, value)`` with every trainable parameter's whole
    float32 value (flat, identical on every rank); then broadcast the frozen parameters
    and buffers and cast the floating ones to ``dtype``."""
    for name, tensor, value in _trainable_values(module, slots, init_values, comm.device):
        full = value.detach().to(comm.device, torch.float32, copy=True).contiguous()
        comm.broadcast(full, src=0, label=name)
        keep(slots.slot(tensor), full.view(-1))
    for name, tensor in whole_tensors(module, slots).items():
        if tensor.is_meta:
            raise ValueError(
                f"[rank {comm.rank}] frozen parameter or buffer {name} is on the meta "
                "device: give it a value in init_values"
            )
        data = tensor.data if tensor.data.is_contiguous() else tensor.data.contiguous()
        tensor.data = data
        comm.broadcast(data, src=0)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)


def _trainable_values(
    module: nn.Module, slots: ParamTable, init_values: InitValues | None, device: torch.device
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, parameter, value) for every trainable parameter, one at a time; init_values
    for frozen parameters and buffers are applied on the way."""
    if init_values is None:
        for name, p in module.named_parameters():
            if slots.get(p) is not None:
                yield name, p, p.detach()
        return
    for name, tensor, value in named_init_values(module, init_values):
        if slots.get(tensor) is not None:
            yield name, tensor, value
        else:
            materialise(tensor, value, device)
