"""Rank 0's initial values on every rank, one trainable parameter at a time.

Each trainable parameter's value (the module's own, or ``init_values``') is broadcast from
rank 0 as a whole float32 tensor and handed to the engine's components, which keep what
their placement needs (the whole value in a bucket, or this rank's slice); then the frozen
parameters and buffers are broadcast whole and cast to the compute dtype. At no point
does a rank hold more than one whole trainable parameter beyond what it keeps:

    rank 0     broadcasts the value itself where it is float32, contiguous and on the
               device already (a copy otherwise: then the given value and the copy);
    rank r>0   drops its own value (its shape is all it needs) and receives into an
               empty tensor;

and the value is let go before the next one is asked for (init_values.init_value_boxes:
no generator of ours holds it meanwhile). With the build's large blocks mapped
(memory.build_heap), freeing it returns its address space too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from zero_comm import Communicator

from .init_values import InitValues, init_value_boxes, materialise
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
    for name, tensor, box in _trainable_values(module, slots, init_values, comm.device):
        full = _to_receive(box.pop(), comm)
        comm.broadcast(full, src=0, label=name)
        keep(slots.slot(tensor), full.view(-1))
        del full  # before the next value is made
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


def _to_receive(value: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The float32 tensor this rank broadcasts ``value`` in (module docstring): on rank
    0 ``value`` itself where it can be, never written to (the source of a broadcast is
    read only); elsewhere an empty one of its shape, ``value`` dropped first."""
    if comm.rank == 0:
        return value.detach().to(comm.device, torch.float32).contiguous()
    shape = value.shape
    del value  # the caller holds no other reference: its memory goes before the empty's
    return torch.empty(shape, dtype=torch.float32, device=comm.device)


def _trainable_values(
    module: nn.Module, slots: ParamTable, init_values: InitValues | None, device: torch.device
) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    """(name, parameter, [value]) for every trainable parameter, one at a time, the value
    in a box the caller empties (init_values.init_value_boxes); init_values for frozen
    parameters and buffers are applied on the way."""
    if init_values is None:
        for name, p in module.named_parameters():
            if slots.get(p) is not None:
                yield name, p, [p.detach()]
        return
    for name, tensor, box in init_value_boxes(module, init_values):
        if slots.get(tensor) is not None:
            yield name, tensor, box
        else:
            materialise(tensor, box.pop(), device)
