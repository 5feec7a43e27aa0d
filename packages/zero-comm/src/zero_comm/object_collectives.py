"""Collectives of picklable Python objects: the part of a
:class:`~zero_comm.communicator.Communicator` that moves objects, not tensors.

    broadcast_object(obj, src)   src's object, a copy on every rank
    all_gather_object(obj)       every rank's object, in rank order

Each pickles to uint8 tensors on the communicator's device and moves them with the
backend's broadcast / all-gather (a size first, then the bytes, padded to the longest).
Not counted in stats. :class:`ObjectCollectives` is a base of Communicator, as
call_check.CallCheck and node_groups.NodeGroups are.
"""

from __future__ import annotations

import abc
import pickle
from collections.abc import Callable
from typing import Any

import torch

from .handle import Work
from .profiler_ranges import ranged


class ObjectCollectives(abc.ABC):
    """Object collectives over the communicator's own tensor collectives."""

    rank: int
    world_size: int
    device: torch.device

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _wait(self, work: Work, name: str) -> None: ...

    @abc.abstractmethod
    def _enter(
        self, name: str, describe: Callable[[], tuple[int, int, int, int]], label: str = ""
    ) -> None: ...

    @abc.abstractmethod
    def _check_src(self, name: str, src: int) -> int: ...

    @ranged
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Pickle ``obj`` on ``src`` and return a copy on every rank (not counted in stats)."""
        self._enter(
            "broadcast_object", lambda: (-1, 0, -1, self._check_src("broadcast_object", src))
        )
        if self.world_size == 1:
            return obj
        payload = _to_bytes(obj, self.device) if self.rank == src else None
        size = torch.tensor(
            [payload.numel() if payload is not None else 0], dtype=torch.int64, device=self.device
        )
        self._wait(self._broadcast(size, src), "broadcast_object (size)")
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if payload.numel() > 0:
            self._wait(self._broadcast(payload, src), "broadcast_object")
        return pickle.loads(payload.cpu().numpy().tobytes())

    @ranged
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Pickle ``obj`` on every rank and return the list of all ranks' objects."""
        self._enter("all_gather_object", lambda: (-1, 0, -1, -1))
        if self.world_size == 1:
            return [obj]
        payload = _to_bytes(obj, self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self._wait(self._all_gather(sizes, size), "all_gather_object (sizes)")
        longest = int(sizes.max().item())
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: payload.numel()].copy_(payload)
        everyone = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
        self._wait(self._all_gather(everyone, padded), "all_gather_object")
        rows = everyone.view(self.world_size, longest).cpu()
        return [
            pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)
        ]


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    return (
        torch.frombuffer(data, dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
