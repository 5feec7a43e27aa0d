"""One stage-3 fetch unit at run time: its full buffers, its parameters' views into them,
and its state (param_gatherer drives the transitions and says what each state means)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from zero_comm import Handle, QuantizedHandle

from .param_table import ParamSlot


class UnitState(Enum):
    RELEASED = "released"
    GATHERING = "gathering"  # all-gathers launched, not yet waited for
    GATHERED = "gathered"
    PERSISTENT = "persistent"


@dataclass(eq=False)
class GatherUnit:
    """One unit: its buckets' full buffers and (group, bucket) keys of this rank's
    shards, its slots (and the bucket, within the unit, of each), and its run-time state."""

    label: str
    fulls: list[torch.Tensor]
    shards: list[tuple[int, int]]
    slots: list[ParamSlot]
    slot_buckets: list[int]
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

    def __post_init__(self) -> None:
        self.numel = sum(full.numel() for full in self.fulls)
        self.views = [
            self.fulls[k][s.flat.start : s.flat.stop].view(s.shape)
            for s, k in zip(self.slots, self.slot_buckets, strict=True)
        ]
        self.placeholders = [
            torch.full((1,), float("nan"), dtype=s.param.dtype, device=s.param.device).expand(
                s.shape
            )
            for s in self.slots
        ]
        if not self.persistent:  # views are made while the storage exists, then it goes
            for full in self.fulls:
                full.untyped_storage().resize_(0)

    def expect(self, *states: UnitState, doing: str) -> None:
        """Raise unless the unit is in one of ``states``."""
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise RuntimeError(
                f"{self.label}: cannot {doing} a unit that is {self.state.value} (it must be "
                f"{allowed}); this is a bug in the engine's gather bookkeeping"
            )
