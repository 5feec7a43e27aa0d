"""Bytes the peers (DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed) communicate, by hooking.

Our engines count their own traffic (``Communicator.stats``). The peers call
``torch.distributed``'s Python collectives (DDP through the ``allreduce_hook`` comm hook that
tools.peers.bench registers, FSDP2 through ``all_gather_single``/``reduce_scatter_single``,
DeepSpeed through ``all_gather_into_tensor``/``reduce_scatter_tensor``/``all_reduce`` and the
rest), so
:func:`install` wraps those functions, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, once, before DeepSpeed caches references to them. A
wrapped call adds to the active :class:`CallCounter` when one is active and its ``group``
(``None`` meaning the world) is the counter's group, or any group for a counter made with
``ANY_GROUP`` (DeepSpeed makes its own groups: a clone of the world for data parallelism);
nested calls (a deprecated alias calling its replacement) count once. The volume is
zero_comm's ring convention (``zero_comm.stats.ring_volume``): all_reduce 2(N-1)/N B,
all_gather and reduce_scatter (N-1)/N of the full buffer, broadcast B, so the peers' figures
compare with our engines'.
Collectives a peer issues from C++ without passing through Python would be missed; none of the
four does for its gradients or parameters in the configurations tools.peers.bench uses.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from zero_comm.stats import ring_volume

# name -> (collective of the ring convention, argument holding the buffer, how to size it)
_WRAPPED: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
}
ANY_GROUP = object()
_installed = False
_active: CallCounter | None = None
_depth = 0


class CallCounter:
    """Calls and ring-convention bytes of the collectives on one process group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.calls: dict[str, int] = {}
        self.volume_bytes: dict[str, float] = {}

    def reset(self) -> None:
        self.calls.clear()
        self.volume_bytes.clear()

    @property
    def total_bytes(self) -> float:
        return sum(self.volume_bytes.values())

    def matches(self, group: Any) -> bool:
        if self.group is ANY_GROUP:
            return True
        world = c10d.GroupMember.WORLD
        mine = world if self.group is None else self.group
        return (world if group is None else group) is mine

    def record(self, collective: str, numel: int, itemsize: int, group: Any) -> None:
        size = dist.get_world_size(group)
        volume = float(ring_volume(collective, numel, size)) * itemsize
        self.calls[collective] = self.calls.get(collective, 0) + 1
        self.volume_bytes[collective] = self.volume_bytes.get(collective, 0.0) + volume

    def __enter__(self) -> CallCounter:
        global _active
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None


def _size(value: Any) -> tuple[int, int]:
    """(elements, bytes per element) of a tensor or a list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel(), value.element_size()
    tensors = [t for t in value if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors), tensors[0].element_size() if tensors else 0


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    collective, argument = _WRAPPED[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        global _depth
        counter = _active
        if counter is not None and _depth == 0:
            bound = signature.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            if counter.matches(group) and argument in bound.arguments:
                numel, itemsize = _size(bound.arguments[argument])
                counter.record(collective, numel, itemsize, group)
        _depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _depth -= 1

    return counted


def install() -> None:
    """Wrap the collectives (idempotent). Call before importing DeepSpeed."""
    global _installed
    if _installed:
        return
    for name in _WRAPPED:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = _wrap(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    _installed = True
