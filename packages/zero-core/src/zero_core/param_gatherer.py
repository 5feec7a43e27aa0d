"""Stage 3 at run time: gather a unit's parameters just before use, prefetch, free them.

Each unit owns, per bucket, a *full* buffer (padded, compute dtype) whose storage exists
only while the unit is gathered; this rank's *shard* of it is kept for good by the
parameter shards' tier (parameter_shards), which hands it over for each gather (a view
on the device, or a copy fetched from host memory or disk) and takes it back after:

    released   full storage: 0 bytes     parameters: a 1-element NaN placeholder expanded
                                         to the logical shape (shape, dtype, numel stay
                                         right; reading gives NaN, writing raises)
    gathered   full storage: all_gather(shard) from every rank, in rank order
                                         parameters: views into full

Releasing resizes the storage to zero instead of dropping the tensor, so views autograd
saved in forward (``weight.t()`` for a matmul) point at the same storage when backward
gathers it again.

States. Each unit is in one :class:`UnitState` at a time, and every transition checks
the state it starts from (a wrong one raises, naming the unit):

    RELEASED --start_gather--> GATHERING --wait--> GATHERED --release--> RELEASED
    PERSISTENT (the persistent unit: gathered for good; regather refreshes it)

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

Coalesced gathers (``coalesce_numel``). The units one prefetch starts, in the record's
order, are cut into runs gathered the same way (plain, qwZ, or hpZ's secondary gather;
hierarchical gathers never coalesce) of at most ``coalesce_numel`` elements in all, and each
run is one all-gather (zero_comm.all_gather_coalesced), waited for as a whole when its
first unit is demanded. Every full buffer gets the bits its own gather would give, and the
bytes are the same. What changes is the number of collectives (a forward over the default
GPT's 18 units makes 5 all-gathers at 2^18 elements instead of 18), and memory: from the
launch to the first wait a received buffer as large as the run's full buffers, and a send
buffer of 1/N of it. Neither counts in ``max_live_numel``; both are at most
``coalesce_numel`` elements. A unit demanded before it was prefetched is gathered by itself.

Kept for backward. Backward first demands the units forward used last. A forward run with
gradients enabled does not release the first unit of the backward record and the units
after it within ``backward_head_numel`` elements (the *backward head*): they stay gathered
from their forward to backward, with the values forward used, and backward starts without
gathering them again; it takes them as gathered ahead, so its prefetching resumes once
it has used them. With ``backward_head_numel <= prefetch_numel`` the gathered set at
backward's start is the one backward would gather there anyway; a larger head holds up
to the difference more there, and each step moves the head's elements once fewer (as
DeepSpeed's ``stage3_max_reuse_distance`` keeps a parameter used again soon):

    all-gather per step = (2P - head) (N-1)/N     (P: padded elements of the units)

The head is kept only until backward begins. Anything that writes the compute shards
(``drop_kept``: the optimizer step, a checkpoint load) and a forward that starts instead
release it first, so no gathered unit ever outlives the shard values it came from.

hpZ (ZeRO++'s secondary partition). With a ``secondary`` communicator (P consecutive
ranks, one node), each forward gather of a unit also keeps this rank's 1/P of every
full buffer; a gather during backward then all-gathers those parts inside the group
instead of the shards over every rank:

    forward   full = all_gather over N of the shards       keep full.view(P, -1)[rank % P]
    backward  full = all_gather over P of the kept parts   (no byte leaves the group)

The parts are the forward's gathered bits, so backward computes with exactly the
weights forward used (lossless, and with quantized forward gathers too); they are
dropped when the backward pass ends.

Pinned micro-steps (``pin_slots``: ranks running different numbers of micro-batch slots,
zero_core.slot_rows). Every gather is a collective that every rank must join, but a
rank with more slots runs more forward and backward passes. So the first forward of a
micro-step gathers every unit, in unit order, and nothing is released until this rank's
``pin_slots`` backward passes have ended: every rank issues the same gathers whatever
its slot count, and the parameters take what stage 2's take from that forward to the
last backward (the price of uneven counts at stage 3).

On a torch.profiler timeline: each start of gathers is ``zero::gather_unit``, each wait for
a unit ``zero::gather_unit.wait`` and each release ``zero::free_unit`` (the collectives
inside them are the communicator's ``zero::all_gather`` ranges).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Protocol

import torch

from zero_comm import (
    BlockQuantizer,
    Communicator,
    Handle,
    QuantizedHandle,
    all_gather_coalesced,
    quantized_all_gather,
)
from zero_comm.hierarchy import hierarchical_all_gather
from zero_comm.profiler_ranges import profiler_range

from .coalescing import coalesced_groups
from .gather_unit import GatherUnit, UnitState


def backward_head_length(
    numels: Sequence[int], head_numel: int, max_live_numel: float = float("inf")
) -> int:
    """How many of the units ``numels`` (their elements, in backward's order) a forward
    keeps gathered for backward's start: the first one, then the next ones while those
    after the first total at most ``head_numel`` elements, and all of them at most
    ``max_live_numel``. The one rule of the engine (ParameterGatherer) and of
    zero-estimate's link bytes (link_traffic.backward_head_buckets)."""
    ahead = total = 0
    for position, numel in enumerate(numels):
        if position > 0 and ahead + numel > head_numel:
            return position
        if total + numel > max_live_numel:
            return position
        total += numel
        ahead += numel if position > 0 else 0
    return len(numels)


class ShardSource(Protocol):
    """Where the gatherer gets this rank's slice of a bucket (group, bucket) from."""

    def take(self, group: int, bucket: int) -> torch.Tensor: ...

    def give_back(self, tensor: torch.Tensor) -> None: ...

    def read_ahead(self, group: int, bucket: int) -> None: ...


class GatherPath(Enum):
    """How a unit's gather runs; units on one path (but the hierarchical one) can share
    a collective."""

    PLAIN = "plain"  # all_gather of the shards over every rank
    QUANTIZED = "quantized"  # qwZ's quantized all_gather of the shards
    HIERARCHICAL = "hierarchical"  # across nodes, then inside them: never coalesced
    SECONDARY = "secondary"  # hpZ in backward: all_gather of the kept parts in the node


class Pass(Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class ParameterGatherer:
    """Gathers, prefetches and frees the units of one model; see the module docstring."""

    def __init__(
        self,
        comm: Communicator,
        units: list[GatherUnit],
        source: ShardSource,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        keep_backward_head: bool = True,
        backward_head_numel: int | None = None,
        secondary: Communicator | None = None,
        weight_codec: BlockQuantizer | None = None,
        allow_fallback: bool = False,
        hierarchical: bool = False,
        coalesce_numel: int = 0,
    ) -> None:
        """``keep_backward_head``: a forward with gradients keeps the backward head
        gathered, up to ``backward_head_numel`` elements past its first unit (None:
        ``prefetch_numel``; module docstring); ``secondary``: hpZ's group (see the module
        docstring), or None;
        ``weight_codec``: qwZ, the gathers of non-persistent units move int8 blocks
        (zero_comm.quantized_all_gather), or None; ``hierarchical``: gather across nodes
        first, then inside them (zero_comm.hierarchy.hierarchical_all_gather);
        ``coalesce_numel``: units started together (a prefetch) on one path share one
        all-gather while their elements add up to at most this many (module docstring)."""
        self.hierarchical = hierarchical
        self.coalesce_numel = coalesce_numel
        self.comm = comm
        self.secondary = secondary
        self.weight_codec = weight_codec
        self.allow_fallback = allow_fallback
        self.units = units
        self.source = source
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.keep_backward_head = keep_backward_head
        self.backward_head_numel = (
            prefetch_numel if backward_head_numel is None else backward_head_numel
        )
        self._ahead: set[int] = set()  # prefetched, not yet demanded in this pass
        self._kept: set[int] = set()  # gathered in forward, held for backward's start
        self._head: set[int] = set()  # in a forward: the backward head it keeps
        self.traces: dict[Pass, list[int]] = {}
        self.phase: Pass | None = None
        self._recording: list[int] = []
        self._position = 0
        self._trace: list[int] | None = None
        self.order_changes = 0
        self.pin_slots = 0  # > 0: pinned micro-steps of that many backward passes
        self._pinned_backwards = 0  # backward passes left before the pinned units go
        self.live_numel = 0
        self.peak_live_numel = 0
        for unit in units:
            if unit.persistent:
                self._resize(unit, gathered=True)
                unit.state = UnitState.PERSISTENT
                self._attach(unit)
            else:
                self._detach(unit)

    # ------------------------------------------------------------------ passes
    def begin_pass(self, phase: Pass) -> None:
        """Start a forward or backward pass: demands are recorded and, when a record of
        the previous pass of this kind exists, prefetched along it. A backward pass takes
        over the units forward kept for it as gathered ahead; a forward releases them."""
        kept = self._kept if phase is Pass.BACKWARD else set()
        self._kept = set()
        self.end_pass(keep=kept)
        self._ahead = {i for i in kept if self.units[i].state is UnitState.GATHERED}
        self._head = self._backward_head() if phase is Pass.FORWARD else set()
        self.phase = phase
        self._recording = []
        self._position = 0
        self._trace = self.traces.get(phase)
        for unit in self.units:
            unit.grads_seen = 0
            unit.users = 0
        if phase is Pass.FORWARD and self.pin_slots and not self._pinned_backwards:
            self._pin_all()

    def _pin_all(self) -> None:
        """Gather every unit now, in unit order, and keep them all until ``pin_slots``
        backward passes have ended (module docstring: pinned micro-steps)."""
        self._pinned_backwards = self.pin_slots
        self._start_gathers([u for u in self.units if u.state is UnitState.RELEASED])
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                self._wait(unit)

    def end_pass(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Wait for every prefetch, release every non-persistent unit but ``keep`` (and
        a forward's backward head, see the module docstring), keep the record."""
        if self.phase is Pass.FORWARD and torch.is_grad_enabled():
            self._kept = set(self._head)
            keep = set(keep) | self._kept
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                self._wait(unit)
        for index, unit in enumerate(self.units):
            if unit.state is UnitState.GATHERED and index not in keep:
                self._release(unit)
        self._kept &= {i for i, u in enumerate(self.units) if u.state is UnitState.GATHERED}
        if self.phase is not None:
            self.traces[self.phase] = self._recording
        if self.phase is Pass.BACKWARD:
            for unit in self.units:
                unit.secondary_parts = []
            if self._pinned_backwards:
                self._pinned_backwards -= 1
                if not self._pinned_backwards:  # the micro-step's last slot: unpin
                    for unit in self.units:
                        if unit.state is UnitState.GATHERED and not unit.persistent:
                            self._release(unit)
        self.phase = None
        self._ahead.clear()

    # ----------------------------------------------------------------- demands
    def fetch(self, indices: Iterable[int]) -> None:
        """Make the units ``indices`` gathered now (a module is about to run)."""
        for index in indices:
            unit = self.units[index]
            if unit.persistent:
                continue
            self._record(index)
            self._ahead.discard(index)
            if unit.state is UnitState.RELEASED:
                self._start_gathers([unit])
            if unit.state is UnitState.GATHERING:
                self._wait(unit)
            self._prefetch()

    def enter(self, indices: Iterable[int]) -> None:
        """A module that needs ``indices`` starts: gather them and hold them."""
        indices = list(indices)
        self.fetch(indices)
        for index in indices:
            self.units[index].users += 1

    def leave(self, indices: Iterable[int], *, free: bool) -> None:
        """That module finished; with ``free``, release the units nobody else holds
        (in a forward with gradients enabled, not those of the backward head)."""
        head = self._head if self.phase is Pass.FORWARD and torch.is_grad_enabled() else set()
        for index in indices:
            unit = self.units[index]
            unit.users = max(0, unit.users - 1)
            if free and index not in head:
                self.release_if_unused(index)

    def drop_kept(self) -> None:
        """Release the units kept for backward (the compute shards are about to change,
        so their gathered values would be stale)."""
        if not self._kept:
            return
        kept, self._kept = self._kept, set()
        for index in sorted(kept):
            if self.units[index].state is UnitState.GATHERED and self.units[index].users == 0:
                self._release(self.units[index])

    def backward_head_numels(self) -> list[int]:
        """The full-buffer elements (padded buckets) of the units a forward with
        gradients keeps for backward now: what a step's backward does not gather again."""
        return [full.numel() for i in sorted(self._backward_head()) for full in self.units[i].fulls]

    def _backward_head(self) -> set[int]:
        """The units a forward keeps for backward's start, by the last backward record:
        its first unit and the ones after it within ``backward_head_numel`` elements (all
        within ``max_live_numel``). Empty before the first backward."""
        trace = self.traces.get(Pass.BACKWARD)
        if not trace or not self.keep_backward_head:
            return set()
        # Each unit once, at its first demand; persistent ones are gathered for good.
        order = [i for i in dict.fromkeys(trace) if not self.units[i].persistent]
        kept = backward_head_length(
            [self.units[i].numel for i in order], self.backward_head_numel, self.max_live_numel
        )
        return set(order[:kept])

    def release_if_unused(self, index: int) -> None:
        """Release unit ``index`` if no running module holds it and it holds storage
        (a unit that is already released, or persistent, stays as it is)."""
        unit = self.units[index]
        if unit.users == 0 and unit.state in (UnitState.GATHERING, UnitState.GATHERED):
            if unit.state is UnitState.GATHERING:
                self._wait(unit)
            self._release(unit)

    def gradient_arrived(self, index: int) -> bool:
        """A trainable parameter of unit ``index`` got its gradient in this backward;
        True when that was the last one (nothing in backward needs the unit any more)."""
        unit = self.units[index]
        unit.grads_seen += 1
        return unit.grads_seen == len(unit.slots)

    def regather(self, index: int) -> None:
        """Gather the persistent unit again (after the optimizer step)."""
        unit = self.units[index]
        unit.expect(UnitState.PERSISTENT, doing="regather")
        self._launch(unit)
        self._finish_gathers(unit)

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
        """Gather ahead along the trace within the windows; then ask the shards' tier to
        fetch the units after those (up to ``prefetch_numel`` more), so that a unit's
        shards are in memory (read from disk, say) before its gather starts."""
        trace = self._trace
        if trace is None or self.prefetch_numel == 0:
            return
        ahead = sum(self.units[i].numel for i in self._ahead)
        live = self.live_numel
        starting: list[GatherUnit] = []
        for position in range(self._position, len(trace)):
            unit = self.units[trace[position]]
            if unit.state is not UnitState.RELEASED or unit in starting:
                continue
            if ahead + unit.numel > self.prefetch_numel:
                break
            if live + unit.numel > self.max_live_numel:
                break
            starting.append(unit)
            self._ahead.add(trace[position])
            ahead += unit.numel
            live += unit.numel
        else:
            position = len(trace)  # every unit ahead started: nothing left to read ahead
        self._start_gathers(starting)
        fetched = 0
        for index in trace[position:]:
            unit = self.units[index]
            if unit.state is not UnitState.RELEASED or unit.persistent:
                continue
            if fetched + unit.numel > self.prefetch_numel:
                return
            for group, bucket in unit.shards:
                self.source.read_ahead(group, bucket)
            fetched += unit.numel

    def _start_gathers(self, units: list[GatherUnit]) -> None:
        """Start gathering ``units`` (in this order on every rank): consecutive ones on
        the same path, up to ``coalesce_numel`` elements in all, share one collective."""
        if units:
            with profiler_range("gather_unit"):
                self._start_gathers_now(units)

    def _start_gathers_now(self, units: list[GatherUnit]) -> None:
        for unit in units:
            unit.expect(UnitState.RELEASED, doing="start gathering")
        paths = [self._path(unit) for unit in units]
        alone = [path is GatherPath.HIERARCHICAL for path in paths]
        numels = [unit.numel for unit in units]
        order = range(len(units))
        for group in coalesced_groups(order, numels, alone, self.coalesce_numel, paths):
            members = [units[i] for i in group]
            for unit in members:
                self._resize(unit, gathered=True)
            if len(members) == 1:
                self._launch(members[0])
            else:
                self._launch_coalesced(members, paths[group[0]])
            for unit in members:
                unit.state = UnitState.GATHERING

    def _path(self, unit: GatherUnit) -> GatherPath:
        """How the unit's next gather runs (units on one path can share a collective)."""
        if self.secondary is not None and self.phase is Pass.BACKWARD and unit.secondary_parts:
            return GatherPath.SECONDARY
        if unit.persistent or self.weight_codec is None:
            return GatherPath.HIERARCHICAL if self.hierarchical else GatherPath.PLAIN
        return GatherPath.QUANTIZED

    def _launch_coalesced(self, units: list[GatherUnit], path: GatherPath) -> None:
        """Launch one all-gather for every bucket of ``units``, all on ``path``
        (zero_comm's all_gather_coalesced: each full buffer gets the bits of its own
        gather). Its send buffer is a copy, so the shards go back to their tier at once."""
        comm, codec = self.comm, None
        if path is GatherPath.SECONDARY:
            assert self.secondary is not None
            comm = self.secondary
        elif path is GatherPath.QUANTIZED:
            codec = self.weight_codec
        outputs, inputs, taken = [], [], []
        for unit in units:
            unit.from_secondary = path is GatherPath.SECONDARY
            outputs += unit.fulls
            if unit.from_secondary:
                inputs += unit.secondary_parts
            else:
                shards = [self.source.take(g, k) for g, k in unit.shards]
                inputs += shards
                taken += shards
        handle = all_gather_coalesced(
            comm,
            outputs,
            inputs,
            codec,
            allow_fallback=self.allow_fallback,
            label=f"{units[0].label} (+{len(units) - 1} coalesced)",
        )
        for shard in taken:
            self.source.give_back(shard)
        for unit in units:
            unit.handles = [handle]

    def _launch(self, unit: GatherUnit) -> None:
        """Launch the unit's all-gathers: of the parts hpZ kept, in backward when it kept
        them; else of the shards, taken from their tier."""
        path = self._path(unit)
        if path is GatherPath.SECONDARY:
            assert self.secondary is not None
            unit.from_secondary = True
            unit.handles = [
                self.secondary.all_gather(full, part, async_op=True, label=unit.label)
                for full, part in zip(unit.fulls, unit.secondary_parts, strict=True)
            ]
            return
        unit.from_secondary = False
        unit.inputs = [self.source.take(g, k) for g, k in unit.shards]
        unit.handles = [self._gather_one(path, full, shard, unit.label)
                        for full, shard in zip(unit.fulls, unit.inputs, strict=True)]  # fmt: skip

    def _gather_one(
        self, path: GatherPath, full: torch.Tensor, shard: torch.Tensor, label: str
    ) -> Handle | QuantizedHandle:
        """Launch one bucket's all-gather of ``shard`` into ``full`` on ``path``."""
        if path is GatherPath.HIERARCHICAL:
            return hierarchical_all_gather(self.comm, full, shard, label=label)
        if path is GatherPath.QUANTIZED:
            assert self.weight_codec is not None
            return quantized_all_gather(
                self.comm, full, shard, self.weight_codec,
                async_op=True, label=label, allow_fallback=self.allow_fallback,
            )  # fmt: skip
        return self.comm.all_gather(full, shard, async_op=True, label=label)

    def _finish_gathers(self, unit: GatherUnit) -> None:
        for handle in unit.handles:
            handle.wait()
        for shard in unit.inputs:
            self.source.give_back(shard)
        unit.handles, unit.inputs = [], []
        keep = self.phase is Pass.FORWARD and not unit.from_secondary and not unit.persistent
        if self.secondary is not None and keep:
            size, rank = self.secondary.world_size, self.secondary.rank
            unit.secondary_parts = [full.view(size, -1)[rank].clone() for full in unit.fulls]

    def _wait(self, unit: GatherUnit) -> None:
        unit.expect(UnitState.GATHERING, doing="wait for")
        with profiler_range("gather_unit.wait"):
            self._finish_gathers(unit)
            unit.state = UnitState.GATHERED
            self._attach(unit)

    def _release(self, unit: GatherUnit) -> None:
        if self._pinned_backwards:
            return  # pinned for the micro-step (module docstring)
        unit.expect(UnitState.GATHERED, doing="release")
        with profiler_range("free_unit"):
            self._detach(unit)
            if unit.lent:  # the user may have kept views of the gathered storage
                unit.renew_buffers()
                unit.lent = False
            self._resize(unit, gathered=False)
            unit.state = UnitState.RELEASED

    def _resize(self, unit: GatherUnit, *, gathered: bool) -> None:
        """Give the unit's full buffers their storage, or take it away."""
        for full in unit.fulls:
            full.untyped_storage().resize_(full.numel() * full.element_size() if gathered else 0)
        if not unit.persistent:
            self.live_numel += unit.numel if gathered else -unit.numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _attach(self, unit: GatherUnit) -> None:
        for slot, view in zip(unit.slots, unit.views, strict=True):
            slot.param.data = view

    def _detach(self, unit: GatherUnit) -> None:
        for slot, placeholder in zip(unit.slots, unit.placeholders, strict=True):
            slot.param.data = placeholder
