"""One stage-3 fetch unit at run time: its buckets (each with its full buffer), its
parameters' views into them, and its state (param_gatherer drives the transitions and says
what each state means).

    unit u      | bucket (g, k): full_buffer | bucket (g, k+1): full_buffer | ...
    gathered    every rank's slice of each bucket (all-gathered from the compute shards)
    released    the full buffers keep their shape and views but have no storage
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from zero_comm import Handle, QuantizedHandle

from .buckets import Bucket
from .param_table import ParamSlot


class UnitState(Enum):
    RELEASED = "released"
    GATHERING = "gathering"  # all-gathers launched, not yet waited for
    GATHERED = "gathered"
    PERSISTENT = "persistent"


@dataclass(eq=False)
class UnitBucket(Bucket):
    """A bucket of a fetch unit (a unit's buckets never hold another unit's parameters):
    ``full_buffer`` is the whole bucket, every rank's slice, in the compute dtype; it has
    storage only while its unit is gathered (always, for the persistent unit)."""

    full_buffer: torch.Tensor


@dataclass(eq=False)
class GatherUnit:
    """One unit: its buckets, their slots in bucket order, and its run-time state."""

    label: str
    buckets: list[UnitBucket]
    persistent: bool = False
    state: UnitState = UnitState.RELEASED
    users: int = 0  # modules running now that need the unit
    grads_seen: int = 0  # gradients of its slots in this backward
    handles: list[Handle | QuantizedHandle] = field(default_factory=list)  # GATHERING
    secondary_parts: list[torch.Tensor] = field(default_factory=list)  # hpZ, forward to backward
    from_secondary: bool = False  # the gather in flight reads secondary_parts
    inputs: list[torch.Tensor] = field(default_factory=list)  # shards taken, while GATHERING
    views: list[torch.Tensor] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)
    slots: list[ParamSlot] = field(init=False, default_factory=list)
    lent: bool = False  # gathered for the user (gathered_parameters) since its last release

    def __post_init__(self) -> None:
        self.slots = [slot for bucket in self.buckets for slot in bucket.slots]
        self.numel = sum(full.numel() for full in self.fulls)
        self._make_views()
        self.placeholders = [
            torch.full((1,), float("nan"), dtype=s.param.dtype, device=s.param.device).expand(
                s.shape
            )
            for s in self.slots
        ]
        if not self.persistent:  # views are made while the storage exists, then it goes
            for full in self.fulls:
                full.untyped_storage().resize_(0)

    def _make_views(self) -> None:
        self.views = [
            bucket.full_buffer[s.flat.start : s.flat.stop].view(s.shape)
            for bucket in self.buckets
            for s in bucket.slots
        ]

    def renew_buffers(self) -> None:
        """Give each bucket a new full buffer (and the parameters new views into it),
        leaving the gathered storage to whatever still holds a view of it: a tensor kept
        from a ``gathered_parameters`` block (``p.data.cpu()`` is ``p.data`` itself on a
        CPU device; DeepSpeed-Chat's ZeRO-3 export keeps them) stays whole and unchanged,
        instead of pointing into storage the release takes away. Costs one unit's
        buffers, on the user's path only; the old storage goes with its last view."""
        for bucket in self.buckets:
            bucket.full_buffer = torch.empty_like(bucket.full_buffer)
        self._make_views()

    @property
    def fulls(self) -> list[torch.Tensor]:
        """Each bucket's full buffer, in order (what the all-gathers write)."""
        return [bucket.full_buffer for bucket in self.buckets]

    @property
    def shards(self) -> list[tuple[int, int]]:
        """(group, bucket) of each bucket, in order: which slice of this rank's compute
        shard each all-gather reads (ParameterShards.take)."""
        return [(bucket.group, bucket.index) for bucket in self.buckets]

    def expect(self, *states: UnitState, doing: str) -> None:
        """Raise unless the unit is in one of ``states``."""
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise RuntimeError(
                f"{self.label}: cannot {doing} a unit that is {self.state.value} (it must be "
                f"{allowed}); this is a bug in the engine's gather bookkeeping"
            )
