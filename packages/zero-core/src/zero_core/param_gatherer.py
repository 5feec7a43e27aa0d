"""Stage 3 at run time: gather a unit's parameters just before use, prefetch, free them.

Each unit owns, per bucket, a *full* buffer (padded, compute dtype) whose storage exists
only while the unit is gathered, and this rank's *shard* of it (kept for good):

    released   full storage: 0 bytes     parameters: a 1-element NaN placeholder expanded
                                         to the logical shape (shape, dtype, numel stay
                                         right; reading gives NaN, writing raises)
    gathered   full storage: all_gather(shard) from every rank, in rank order
                                         parameters: views into full

Releasing resizes the storage to zero instead of dropping the tensor, so views autograd
saved in forward (``weight.t()`` for a matmul) point at the same storage when backward
gathers it again.

Passes. Forward and backward are each a *pass*; the units demanded during a pass are
recorded, and the next pass of the same kind prefetches along that record: after a demand
at position i, the units at i+1, i+2, ... are gathered asynchronously while at most
``prefetch_numel`` elements are gathered ahead and at most ``max_live_numel`` are gathered
in all. A demand that differs from the record (the model took another path) stops the
prefetching for the rest of that pass, is counted in ``order_changes``, and the pass's own
record replaces the old one. Every decision depends only on the sequence of demands, so
ranks that run the same modules in the same order issue the same collectives; each
all_gather is labelled with its unit, so ranks that do not get a CollectiveMismatchError
naming the modules (with the communicator's consistency check on, its default).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from zero_comm import Communicator, Handle

from .flat_layout import Range


@dataclass
class GatherUnit:
    """One unit: its buckets' full buffers and this rank's shards, and its parameters'
    places (bucket index within the unit, flat range in that bucket)."""

    label: str
    fulls: list[torch.Tensor]
    shards: list[torch.Tensor]
    params: list[tuple[nn.Parameter, int, Range]]
    persistent: bool = False
    trainable_count: int = 0
    views: list[torch.Tensor] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.numel = sum(full.numel() for full in self.fulls)
        self.views = [
            self.fulls[k][flat.start : flat.stop].view(p.shape) for p, k, flat in self.params
        ]
        self.placeholders = [
            torch.full((1,), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
            for p, _, _ in self.params
        ]
        if not self.persistent:  # views are made while the storage exists, then it goes
            for full in self.fulls:
                full.untyped_storage().resize_(0)


class ParameterGatherer:
    """Gathers, prefetches and frees the units of one model; see the module docstring."""

    def __init__(
        self,
        comm: Communicator,
        units: list[GatherUnit],
        *,
        prefetch_numel: int,
        max_live_numel: int,
    ) -> None:
        self.comm = comm
        self.units = units
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.gathered = [False] * len(units)
        self.users = [0] * len(units)
        self.grads_seen = [0] * len(units)
        self._in_flight: dict[int, list[Handle]] = {}
        self._ahead: set[int] = set()  # prefetched, not yet demanded in this pass
        self.traces: dict[str, list[int]] = {}
        self.phase: str | None = None
        self._recording: list[int] = []
        self._position = 0
        self._trace: list[int] | None = None
        self.order_changes = 0
        self.live_numel = 0
        self.peak_live_numel = 0
        for index, unit in enumerate(units):
            if unit.persistent:
                self._allocate(index)
                self._attach(index)
            else:
                self._free(index)

    # ------------------------------------------------------------------ passes
    def begin_pass(self, phase: str) -> None:
        """Start a forward or backward pass: demands are recorded and, when a record of
        the previous pass of this kind exists, prefetched along it."""
        self.end_pass()
        self.phase = phase
        self._recording = []
        self._position = 0
        self._trace = self.traces.get(phase)
        self.grads_seen = [0] * len(self.units)
        self.users = [0] * len(self.units)

    def end_pass(self) -> None:
        """Wait for every prefetch, release every non-persistent unit, keep the record."""
        for index in list(self._in_flight):
            self._wait(index)
        for index, unit in enumerate(self.units):
            if not unit.persistent and self.gathered[index]:
                self.release(index)
        if self.phase is not None:
            self.traces[self.phase] = self._recording
        self.phase = None
        self._ahead.clear()

    # ----------------------------------------------------------------- demands
    def fetch(self, indices: Iterable[int]) -> None:
        """Make the units ``indices`` gathered now (a module is about to run)."""
        for index in indices:
            if self.units[index].persistent:
                continue
            self._record(index)
            self._ahead.discard(index)
            if index in self._in_flight:
                self._wait(index)
            elif not self.gathered[index]:
                self._start_gather(index)
                self._wait(index)
            self._prefetch()

    def enter(self, indices: Iterable[int]) -> None:
        """A module that needs ``indices`` starts: gather them and hold them."""
        indices = list(indices)
        self.fetch(indices)
        for index in indices:
            self.users[index] += 1

    def leave(self, indices: Iterable[int], *, free: bool) -> None:
        """That module finished; with ``free``, release the units nobody else holds."""
        for index in indices:
            self.users[index] = max(0, self.users[index] - 1)
            if free:
                self.release_if_unused(index)

    def release_if_unused(self, index: int) -> None:
        if self.users[index] == 0:
            self.release(index)

    def release(self, index: int) -> None:
        """Free unit ``index``'s full buffers; its parameters become placeholders."""
        if self.units[index].persistent or not self.gathered[index]:
            return
        if index in self._in_flight:
            self._wait(index)
        self._free(index)

    def gradient_arrived(self, index: int) -> bool:
        """A trainable parameter of unit ``index`` got its gradient in this backward;
        True when that was the last one (nothing in backward needs the unit any more)."""
        self.grads_seen[index] += 1
        return self.grads_seen[index] == self.units[index].trainable_count

    def regather(self, index: int) -> None:
        """Gather a gathered unit again (the persistent unit, after the optimizer step)."""
        self._start_gather(index)
        self._wait(index)

    # ---------------------------------------------------------------- internals
    def _record(self, index: int) -> None:
        if self.phase is None:
            return
        self._recording.append(index)
        trace = self._trace
        if trace is None:
            return
        if self._position < len(trace) and trace[self._position] == index:
            self._position += 1
            return
        self.order_changes += 1
        self._trace = None  # the model took another path: stop prefetching this pass

    def _prefetch(self) -> None:
        trace = self._trace
        if trace is None or self.prefetch_numel == 0:
            return
        ahead = sum(self.units[i].numel for i in self._ahead)
        for index in trace[self._position :]:
            unit = self.units[index]
            if self.gathered[index] or index in self._in_flight:
                continue
            if ahead + unit.numel > self.prefetch_numel:
                return
            if self.live_numel + unit.numel > self.max_live_numel:
                return
            self._start_gather(index)
            self._ahead.add(index)
            ahead += unit.numel

    def _start_gather(self, index: int) -> None:
        unit = self.units[index]
        if not self.gathered[index]:
            self._allocate(index)
        handles = []
        for full, shard in zip(unit.fulls, unit.shards, strict=True):
            handle = self.comm.all_gather(full, shard, async_op=True, label=unit.label)
            handles.append(handle)
        self._in_flight[index] = handles

    def _wait(self, index: int) -> None:
        for handle in self._in_flight.pop(index):
            handle.wait()
        self._attach(index)

    def _allocate(self, index: int) -> None:
        unit = self.units[index]
        for full in unit.fulls:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        self.gathered[index] = True
        self.live_numel += 0 if unit.persistent else unit.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _attach(self, index: int) -> None:
        unit = self.units[index]
        for (p, _, _), view in zip(unit.params, unit.views, strict=True):
            p.data = view

    def _free(self, index: int) -> None:
        unit = self.units[index]
        for (p, _, _), placeholder in zip(unit.params, unit.placeholders, strict=True):
            p.data = placeholder
        for full in unit.fulls:
            full.untyped_storage().resize_(0)
        if self.gathered[index]:
            self.live_numel -= unit.numel
        self.gathered[index] = False
