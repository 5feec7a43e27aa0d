"""Reduce-scatter gradient buckets, in one order on every rank, overlapped with backward.

A bucket is *complete* when every parameter in it has its gradient for this micro-step.
Buckets are launched strictly in one canonical order: by default last bucket first (the
order backward usually completes them), over all parameter groups; stage 3 passes its own
(fetch units in reverse registration order):

    complete:  b5  b4  b2  b3  b1  b0      (the order hooks happen to fire)
    launched:  b5  b4  .   b3+b2  b1  b0   (b2 waits for b3: same order on every rank)

so every rank issues the same sequence of collectives even if its hooks fire in another
order or some parameter gets no gradient (those buckets complete in ``finish``). At most
``max_in_flight`` reduce-scatters are outstanding; each one's result (this rank's slice of
the bucket) is added into that bucket's *target*, a view of the rank's gradient shard.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from zero_comm import Communicator, Handle

from .flat_layout import Range


@dataclass
class BucketSlot:
    """One bucket: its parameters' places, where its reduced slice goes, its staging."""

    numel: int  # padded bucket elements
    slice_numel: int
    params: list[tuple[torch.nn.Parameter, Range]]
    target: torch.Tensor  # slice_numel elements: this rank's accumulated gradient slice
    persistent: torch.Tensor | None = None  # stage 1: the full-gradient bucket (p.grad views)


class BucketReducer:
    """Collects gradients into buckets and reduce-scatters them in canonical order."""

    def __init__(
        self,
        comm: Communicator,
        slots: list[BucketSlot],
        dtype: torch.dtype,
        max_in_flight: int,
        launch_order: list[int] | None = None,
        labels: list[str] | None = None,
    ) -> None:
        """``launch_order``: slot indices in the order their reduce-scatters are issued
        (default: last slot first); ``labels``: each slot's label for the communicator's
        consistency check."""
        self.comm = comm
        self.launch_order = launch_order or list(range(len(slots) - 1, -1, -1))
        if sorted(self.launch_order) != list(range(len(slots))):
            raise ValueError(f"launch_order {launch_order} must list each of {len(slots)} slots")
        self.labels = labels or [""] * len(slots)
        self.slots = slots
        self.dtype = dtype
        self.max_in_flight = max_in_flight
        self.place = {
            id(p): (index, flat) for index, slot in enumerate(slots) for p, flat in slot.params
        }
        self._staging: list[torch.Tensor | None] = [None] * len(slots)
        self._arrived = [0] * len(slots)
        self._next = 0  # position in launch_order of the next bucket to launch
        self._in_flight: deque[tuple[int, Handle, torch.Tensor]] = deque()
        self._first = True
        self._tag = ""
        self._seen: set[int] = set()
        self._position = {index: at for at, index in enumerate(self.launch_order)}

    def begin(self, first_micro_step: bool, tag: str = "") -> None:
        """Start a micro-step; ``tag`` is appended to every label (the micro-step)."""
        self._first = first_micro_step
        self._tag = tag
        self._seen = set()
        self._arrived = [0] * len(self.slots)
        self._next = 0

    def _stage(self, index: int) -> torch.Tensor:
        staging = self._staging[index]
        if staging is None:
            slot = self.slots[index]
            if slot.persistent is not None:
                staging = slot.persistent
            else:
                staging = self.comm.buffers.take(slot.numel, self.dtype)
                staging.zero_()
            self._staging[index] = staging
        return staging

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Hook: ``param.grad`` holds this micro-step's gradient; move it into its bucket."""
        index, flat = self.place[id(param)]
        again = id(param) in self._seen
        if again and self._position[index] < self._next:
            raise RuntimeError(
                f"[rank {self.comm.rank}] a parameter of shape {tuple(param.shape)} received a "
                "second gradient after its bucket was already reduced (reentrant activation "
                "checkpointing does this); use checkpoint(..., use_reentrant=False), or stage 1"
            )
        if param.grad is not None:
            region = self._stage(index)[flat.start : flat.stop]
            if again:
                region.add_(param.grad.reshape(-1))
            else:
                region.copy_(param.grad.reshape(-1))
            param.grad = None
        if not again:
            self._seen.add(id(param))
            self._arrived[index] += 1
        self._launch_ready()

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Stage 1: the gradient is already in place in the persistent bucket."""
        self._arrived[self.place[id(param)][0]] += 1
        self._launch_ready()

    def _complete(self, index: int) -> bool:
        return self._arrived[index] >= len(self.slots[index].params)

    def _launch_ready(self) -> None:
        order = self.launch_order
        while self._next < len(order) and self._complete(order[self._next]):
            self._launch(order[self._next])
            self._next += 1

    def _launch(self, index: int) -> None:
        slot = self.slots[index]
        out = self.comm.buffers.take(slot.slice_numel, self.dtype)
        handle = self.comm.reduce_scatter(
            out, self._stage(index), async_op=True, label=self.labels[index] + self._tag
        )
        assert handle is not None
        self._in_flight.append((index, handle, out))
        while len(self._in_flight) > self.max_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        index, handle, out = self._in_flight.popleft()
        handle.wait()
        slot = self.slots[index]
        if self._first:
            slot.target.copy_(out)
        else:
            slot.target.add_(out)
        self.comm.buffers.give_back(out)
        staging = self._staging[index]
        if staging is not None and slot.persistent is None:
            self.comm.buffers.give_back(staging)
        self._staging[index] = None

    def finish(self) -> None:
        """After backward: complete every bucket (missing gradients are zeros), launch the
        rest in canonical order, and wait for all of them."""
        for index in range(len(self.slots)):
            self._arrived[index] = len(self.slots[index].params)
        self._launch_ready()
        while self._in_flight:
            self._finish_oldest()
