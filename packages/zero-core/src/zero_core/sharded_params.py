"""Parameters partitioned across ranks (stage 3): compute shards, gathered unit by unit.

Per group, this rank's compute shard (its slice of every bucket, as the layout says);
buckets never span two fetch units (fetch_units), and each unit's full buffers exist only
while it is gathered (param_gatherer):

    compute shard (rank r)    | bucket 0 slice | bucket 1 slice | ...   (kept for good)
    unit u, gathered          | bucket 0 (all ranks' slices) | ...      (while in use)

Initial values arrive one parameter at a time (``fill``): the rank keeps its slice, and
the parameter becomes a NaN placeholder of its shape, so no rank ever holds the model.
The persistent unit (parameters of at most ``persistence_threshold`` elements) stays
gathered; it is all-gathered again after every step.
"""

from __future__ import annotations

import torch
from torch import nn

from zero_comm import BlockQuantizer, Communicator

from .buckets import Bucket, build_buckets
from .config.zero_config import ZeroConfig
from .fetch_units import UnitPlan
from .gather_unit import GatherUnit, UnitBucket
from .group_layout import GroupLayout
from .init_values import become
from .master_weights import VisitsTiles
from .offload.tiered_parameters import ParameterShards
from .param_gatherer import ParameterGatherer, Pass
from .param_table import ParamSlot, ParamTable


class ShardedParameters:
    """This rank's compute shards, and the gatherer that makes units whole when used."""

    def __init__(
        self,
        slots: ParamTable,
        layouts: list[GroupLayout],
        plan: UnitPlan,
        dtype: torch.dtype,
        comm: Communicator,
        config: ZeroConfig,
        store: ParameterShards,
        secondary: Communicator | None = None,
        weight_codec: BlockQuantizer | None = None,
    ) -> None:
        """``secondary``: hpZ's group for backward gathers (param_gatherer), or None;
        ``weight_codec``: qwZ's quantizer for the gathers, or None (exact)."""
        self.secondary = secondary
        self.weight_codec = weight_codec
        self.slots = slots
        self.layouts = layouts
        self.plan = plan
        self.dtype = dtype
        self.comm = comm
        self.config = config
        self.store = store
        self._persistent_values: dict[int, torch.Tensor] = {}  # slot index -> whole value
        # Every group's buckets (geometry and slots: a unit's buckets hold the full
        # buffers), and per unit its buckets, in (group, bucket) order.
        self.buckets = build_buckets(layouts, slots)
        self._unit_buckets: list[list[Bucket]] = [[] for _ in range(plan.count)]
        for bucket in self.buckets:
            unit = bucket.slots[0].unit  # a bucket lies within one unit (fetch_units)
            assert unit is not None, "every trainable slot of stage 3 has a unit"
            self._unit_buckets[unit].append(bucket)
        self.gatherer: ParameterGatherer

    def owned_slices(self) -> list[list[torch.Tensor]]:
        """Per group and bucket, this rank's slice of the compute shard (on the device)."""
        return self.store.owned_slices()

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Keep this rank's pieces of ``value`` (float32, whole, flat) in the compute
        shard, and let the parameter become a placeholder so its whole value can go."""
        for piece in slot.pieces:
            local, elements = piece.local_range, piece.param_range
            self.store.fill(slot.group, local.start, value[elements.start : elements.stop])
        if slot.unit == self.plan.persistent:
            self._persistent_values[slot.index] = value.to(self.dtype)
        placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.comm.device)
        become(slot.param, placeholder.expand(slot.shape))

    def finish_build(self) -> None:
        """Every value has arrived: make the units and the gatherer; the persistent unit
        is gathered from the whole values kept by ``fill``."""
        self.store.finish_fill()
        units = [self._unit(index) for index in range(self.plan.count)]
        self.gatherer = ParameterGatherer(
            self.comm,
            units,
            self.store,
            prefetch_numel=self.config.prefetch_numel,
            max_live_numel=self.config.max_live_numel,
            keep_backward_head=self.config.keep_backward_head,
            backward_head_numel=self.config.backward_head_numel,
            secondary=self.secondary,
            weight_codec=self.weight_codec,
            allow_fallback=self.config.allow_quantize_fallback,
            hierarchical=self.config.hierarchical_gather,
            # Uneven shards gather unit by unit (zero_comm's coalesced gather is even).
            coalesce_numel=0 if self.config.shard_weights else self.config.gather_coalesce_numel,
        )
        if self.plan.persistent is not None:
            for bucket in units[self.plan.persistent].buckets:
                for slot in bucket.slots:
                    value = self._persistent_values[slot.index].view(-1)
                    bucket.full_buffer[slot.flat.start : slot.flat.stop] = value
        self._persistent_values = {}

    def _unit(self, index: int) -> GatherUnit:
        """Unit ``index``: the buckets holding its slots, in (group, bucket) order, each
        with its full buffer (freed by GatherUnit unless persistent: allocated unit by
        unit, so no more than one unit's buffers are ever held at set-up)."""
        buckets = [
            UnitBucket(
                *bucket.base(),
                full_buffer=torch.empty(
                    bucket.padded_numel, dtype=self.dtype, device=self.comm.device
                ),
            )
            for bucket in self.unit_buckets(index)
        ]
        return GatherUnit(
            f"parameters of {self.plan.names[index]}",
            buckets,
            persistent=index == self.plan.persistent,
        )

    def unit_buckets(self, index: int) -> list[Bucket]:
        """The buckets of unit ``index``, in (group, bucket) order."""
        return self._unit_buckets[index]

    def reduce_order(self) -> tuple[list[int], list[str]]:
        """Gradient buckets reduced unit by unit, in reverse registration order (the order
        backward usually finishes them), the persistent unit last: the launch order of
        the bucket reducer (indices over every group's buckets) and each bucket's label."""
        persistent = self.plan.persistent
        units = [i for i in range(self.plan.count - 1, -1, -1) if i != persistent]
        units += [] if persistent is None else [persistent]
        order = [bucket.position for index in units for bucket in self.unit_buckets(index)]
        labels = [""] * len(self.buckets)
        for index in range(self.plan.count):
            for bucket in self.unit_buckets(index):
                labels[bucket.position] = f"{self.plan.names[index]} (gradients)"
        return order, labels

    # ------------------------------------------------------------ the step
    def take_master_values(self, group: int, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of this rank's master of ``group``
        (float32, updated) into the compute shard, cast to the compute dtype."""
        self.gatherer.drop_kept()  # units gathered from the old values
        self.store.write(group, start, values)

    def publish(self) -> None:
        """The compute shards hold the updated masters (``take_master_values``); the
        persistent unit, which stays gathered, is gathered again. Other units are
        gathered when next used."""
        self.store.finish_writes()
        if self.plan.persistent is not None:
            self.gatherer.regather(self.plan.persistent)

    def before_backward(self) -> None:
        self.gatherer.begin_pass(Pass.BACKWARD)

    def end_backward(self) -> None:
        """Backward finished (or raised): free what it had gathered, and the
        communicator's free staging buffers (the gradient buckets' staging, used once per
        backward): the optimizer step and the next forward use none, so holding them
        would only add to those phases' peak."""
        if self.gatherer.phase is Pass.BACKWARD:
            self.gatherer.end_pass()
        self.comm.buffers.release_free()

    def gradient_arrived(self, slot: ParamSlot) -> None:
        """Backward gave ``slot`` its gradient: once its unit has all of them, nothing in
        backward needs the unit any more."""
        assert slot.unit is not None
        if self.gatherer.gradient_arrived(slot.unit):
            self.gatherer.release_if_unused(slot.unit)

    # ------------------------------------------------------------ user access
    def _user_units(self, slots: list[ParamSlot]) -> list[int]:
        return sorted({slot.unit for slot in slots if slot.unit is not None})

    def gather_for_user(self, slots: list[ParamSlot]) -> None:
        units = self._user_units(slots)
        for index in units:
            self.gatherer.units[index].lent = True  # released onto new buffers (GatherUnit)
        self.gatherer.enter(units)

    def release_for_user(self, slots: list[ParamSlot]) -> None:
        self.gatherer.leave(self._user_units(slots), free=True)

    def after_write_back(self, masters: VisitsTiles) -> None:
        masters.visit(self.take_master_values)
        self.store.finish_writes()

    def full_bucket(self, group: int, bucket: int) -> torch.Tensor:
        """The gathered full buffer of bucket ``bucket`` of ``group``."""
        wanted = self.buckets.at(group, bucket)
        unit = wanted.slots[0].unit
        assert unit is not None
        found = (b for b in self.gatherer.units[unit].buckets if b.position == wanted.position)
        return next(found).full_buffer

    def report_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """The compute shards, the units gathered now (the persistent one always) and the
        frozen parameters."""
        fulls = [full for unit in self.gatherer.units for full in unit.fulls]
        frozen = [p for p in module.parameters() if self.slots.get(p) is None]
        return [*self.store.device_tensors(), *fulls, *frozen]

    def backward_head_numel(self) -> int:
        """Elements kept gathered from forward into backward (the gatherer's backward head)."""
        return sum(self.gatherer.backward_head_numels())

    @property
    def host_bytes(self) -> int:
        return self.store.host_bytes

    @property
    def disk_bytes(self) -> int:
        return self.store.disk_bytes

    def close(self) -> None:
        self.store.close()
