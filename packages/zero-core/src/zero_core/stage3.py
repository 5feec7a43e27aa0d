"""Stage 3 (P_os+g+p): parameters partitioned too, gathered module by module just in time.

16 elements on N = 4 ranks (one bucket, 4 elements per shard):

    parameter shard (compute dtype)   rank 0 | p p p p |  rank 1 | p p p p |  ...
    gradient shard                    rank 0 | g g g g |  rank 1 | g g g g |  ...
    master + optimizer states         rank 0 | m m m m |  rank 1 | m m m m |  ...
    full parameters                   only while a module that uses them runs

Parameters are grouped into fetch units (fetch_units: one per module, tied weights with
their first module, small parameters in one persistent unit) and laid out in buckets that
never span two units. A forward pre-hook on each module gathers its units (param_gatherer:
prefetching the next ones along the order recorded on the first step) and a forward hook
frees them; a hook on the module's outputs gathers them again when backward reaches the
module, and they are freed once every one of their gradients has been reduce-scattered
(stage 2's bucket reducer, units in reverse registration order).

Memory per rank (mixed precision Adam, K = 12): (2 + 2 + K)Ψ/N plus alignment padding,
plus the persistent parameters (whole), plus the gathered working set: the units of the
modules running now and the prefetched ones, at most ``max_live_numel`` elements beyond
what the running modules need.
Communication per step: all-gather Ψ in forward, again in backward, reduce-scatter Ψ:
3Ψ (N-1)/N (the persistent unit instead: reduce-scatter, then all-gather after the step).
A tied weight used by two modules is gathered for each of them.

Frozen parameters stay whole on every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .fetch_units import plan_units
from .flat_layout import Range
from .group_layout import GroupLayout
from .init_values import become, materialise, named_init_values
from .memory import MemoryReport, optimizer_state_bytes, tensor_bytes
from .param_gatherer import GatherUnit, ParameterGatherer
from .stage2 import Stage2Engine

_BACKWARD, _FORWARD = "backward", "forward"


class Stage3Engine(Stage2Engine):
    """ZeRO stage 3; see the module docstring."""

    # -------------------------------------------------------------- set-up
    def _take_initial_state(self) -> dict[int, torch.Tensor]:
        """Shard every trainable parameter as it comes (rank 0's value, or init_values'),
        so no rank holds more than one whole parameter; frozen parameters and buffers
        are broadcast whole. Returns nothing: the shards are kept on ``self``."""
        trainable = {id(p) for _, p in self.trainable_parameters()}
        self.plan = plan_units(self.module, trainable, self.config.persistence_threshold)
        size = self.comm.world_size
        self.layouts = [
            GroupLayout.build(
                [p.numel() for p in params],
                size,
                self.config.bucket_numel,
                tags=[self.plan.param_unit[id(p)] for p in params],
            )
            for params in self.groups.params
        ]
        self._places: dict[int, tuple[int, int, Range]] = {
            id(p): (g, k, flat)
            for g, (params, layout) in enumerate(zip(self.groups.params, self.layouts, strict=True))
            for p, (k, flat) in zip(params, layout.param_places(), strict=True)
        }
        self.param_shards = [
            torch.zeros(layout.shard_numel, dtype=self.dtype, device=self.comm.device)
            for layout in self.layouts
        ]
        # float32 compute: the compute shard is the master (one copy, 16Ψ/N for Adam).
        self._masters_are_parameters = self.dtype == torch.float32
        self._master_shards = (
            self.param_shards
            if self._masters_are_parameters
            else [
                torch.zeros(layout.shard_numel, device=self.comm.device) for layout in self.layouts
            ]
        )
        self._persistent_values: dict[int, torch.Tensor] = {}
        for name, p, value in self._initial_values(trainable):
            self._shard_initial_value(name, p, value)
        for name, tensor in self.whole_tensors().items():
            if tensor.is_meta:
                raise ValueError(
                    f"[rank {self.comm.rank}] frozen parameter or buffer {name} is on the meta "
                    "device: give it a value in init_values"
                )
            data = tensor.data if tensor.data.is_contiguous() else tensor.data.contiguous()
            tensor.data = data
            self.comm.broadcast(data, src=0)
        return {}

    def _initial_values(
        self, trainable: set[int]
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, tensor, value) for every trainable parameter, one at a time; init_values
        for frozen parameters and buffers are applied on the way."""
        if self._init_values is None:
            for name, p in self.module.named_parameters():
                if id(p) in trainable:
                    yield name, p, p.detach()
            return
        for name, tensor, value in named_init_values(self.module, self._init_values):
            if id(tensor) in trainable:
                yield name, tensor, value
            else:
                materialise(tensor, value, self.comm.device)

    def _shard_initial_value(self, name: str, p: torch.Tensor, value: torch.Tensor) -> None:
        """Rank 0's ``value`` of ``p``: keep this rank's slice (float32 master and compute
        dtype), then let ``p`` become a placeholder so its whole value can be freed."""
        full = value.detach().to(self.comm.device, torch.float32, copy=True).contiguous()
        self.comm.broadcast(full, src=0, label=name)
        group, k, flat = self._place(p)
        bucket = self.layouts[group].buckets[k]
        mine = bucket.layout.shard_flat_range(self.comm.rank)
        piece = flat.intersect(mine)
        if piece.size:
            local = piece.shift(mine.start - bucket.local_offset)
            values = full.view(-1)[piece.start - flat.start : piece.stop - flat.start]
            self._master_shards[group][local.start : local.stop] = values
            self.param_shards[group][local.start : local.stop] = values
        if self.plan.param_unit[id(p)] == self.plan.persistent:
            self._persistent_values[id(p)] = full.to(self.dtype)
        placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.comm.device)
        become(p, placeholder.expand(p.shape))

    def _place(self, p: torch.Tensor) -> tuple[int, int, Range]:
        """(group, bucket, flat range in that bucket) of trainable parameter ``p``."""
        return self._places[id(p)]

    def _cast_module(self) -> None:
        """Frozen parameters and floating buffers to the compute dtype (the trainable ones
        are already placeholders in it)."""
        for tensor in self.whole_tensors().values():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(self.dtype)

    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        plan = self.plan
        members: list[list[tuple[int, int]]] = [[] for _ in range(plan.count)]
        for g, (params, layout) in enumerate(zip(self.groups.params, self.layouts, strict=True)):
            for k, bucket in enumerate(layout.buckets):
                members[plan.param_unit[id(params[bucket.param_indices[0]])]].append((g, k))
        units = []
        for index, buckets in enumerate(members):
            fulls: list[torch.Tensor] = []
            shards: list[torch.Tensor] = []
            placed: list[tuple[nn.Parameter, int, Range]] = []
            for position, (g, k) in enumerate(buckets):
                bucket = self.layouts[g].buckets[k]
                fulls.append(torch.empty(bucket.layout.padded_numel, dtype=self.dtype))
                start = bucket.local_offset
                shards.append(self.param_shards[g][start : start + bucket.slice_numel])
                for i in bucket.param_indices:
                    p = self.groups.params[g][i]
                    placed.append((p, position, self._place(p)[2]))
            units.append(
                GatherUnit(
                    f"parameters of {plan.names[index]}",
                    fulls,
                    shards,
                    placed,
                    persistent=index == plan.persistent,
                    trainable_count=len(placed),
                )
            )
        self._bucket_units = {
            self._place(p)[:2]: (unit, k) for unit in units for p, k, _ in unit.params
        }
        self.gatherer = ParameterGatherer(
            self.comm,
            units,
            prefetch_numel=self.config.prefetch_numel,
            max_live_numel=self.config.max_live_numel,
        )
        if plan.persistent is not None:
            for p, k, flat in units[plan.persistent].params:
                units[plan.persistent].fulls[k][flat.start : flat.stop] = self._persistent_values[
                    id(p)
                ].view(-1)
        self._persistent_values = {}
        self._build_gradient_reducer(members)
        self._register_gradient_hooks()
        self._register_module_hooks()
        masters: list[torch.Tensor] = [torch.nn.Parameter(m) for m in self._master_shards]
        del self._master_shards
        return masters

    def _build_gradient_reducer(self, members: list[list[tuple[int, int]]]) -> None:
        """Gradient buckets reduced unit by unit, in reverse registration order (the order
        backward usually finishes them), the persistent unit last."""
        keys = [(g, k) for g, layout in enumerate(self.layouts) for k in range(len(layout.buckets))]
        slot_of = {key: i for i, key in enumerate(keys)}
        persistent = self.plan.persistent
        units = [i for i in range(self.plan.count - 1, -1, -1) if i != persistent]
        units += [] if persistent is None else [persistent]
        order = [slot_of[key] for index in units for key in members[index]]
        labels = [""] * len(keys)
        for index, buckets in enumerate(members):
            for key in buckets:
                labels[slot_of[key]] = f"{self.plan.names[index]} (gradients)"
        self._build_reducer(order, labels)

    def _register_module_hooks(self) -> None:
        """Gather before each module runs, free after; gather again when backward reaches
        its outputs. Hooks hold the engine weakly (the model must not keep it alive)."""
        engine = weakref.ref(self)
        self._module_hooks: list[Any] = []
        for module in self.module.modules():
            units = self.plan.module_units.get(id(module))
            if not units:
                continue

            def before(module: nn.Module, args: Any, units: Sequence[int] = units) -> None:
                alive = engine()
                if alive is not None:
                    alive.gatherer.enter(units)

            def after(
                module: nn.Module, args: Any, output: Any, units: Sequence[int] = units
            ) -> None:
                alive = engine()
                if alive is not None:
                    alive._after_module(units, output)

            self._module_hooks += [
                module.register_forward_pre_hook(before),
                module.register_forward_hook(after),
            ]

        def root_before(module: nn.Module, args: Any) -> None:
            alive = engine()
            if alive is not None and not alive._in_backward:
                alive.gatherer.begin_pass(_FORWARD)

        def root_after(module: nn.Module, args: Any, output: Any) -> None:
            alive = engine()
            if alive is not None and not alive._in_backward:
                alive.gatherer.end_pass()

        self._module_hooks += [
            self.module.register_forward_pre_hook(root_before, prepend=True),
            self.module.register_forward_hook(root_after),
        ]

    def _after_module(self, units: Sequence[int], output: Any) -> None:
        """A module's forward ran: free its units (not during backward's recomputation,
        whose saved tensors backward is about to use), and arrange for them to be
        gathered again when backward reaches this module's outputs."""
        self.gatherer.leave(units, free=not self._in_backward)
        if self._in_backward or not torch.is_grad_enabled():
            return
        engine = weakref.ref(self)

        def on_output_gradient(grad: torch.Tensor) -> None:
            alive = engine()
            if alive is not None and alive._in_backward:
                alive.gatherer.fetch(units)

        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(on_output_gradient)  # type: ignore[no-untyped-call]

    # -------------------------------------------------------------- the step
    def _before_backward(self, first_micro_step: bool) -> None:
        super()._before_backward(first_micro_step)
        self.gatherer.begin_pass(_BACKWARD)

    def _on_gradient(self, param: torch.Tensor) -> None:
        super()._on_gradient(param)
        if self._in_backward:
            unit = self.plan.param_unit[id(param)]
            if self.gatherer.gradient_arrived(unit):
                self.gatherer.release_if_unused(unit)

    def _reduce_gradients(self, first_micro_step: bool) -> None:
        super()._reduce_gradients(first_micro_step)
        self.gatherer.end_pass()

    def backward(self, loss: torch.Tensor) -> None:
        try:
            super().backward(loss)
        finally:
            if self.gatherer.phase == _BACKWARD:
                self.gatherer.end_pass()  # backward raised: free what it had gathered

    def _publish_parameters(self) -> None:
        """The compute-dtype shards from the updated masters; the persistent unit, which
        stays gathered, is gathered again. Other units are gathered when next used."""
        self._shards_from_masters()
        if self.plan.persistent is not None:
            self.gatherer.regather(self.plan.persistent)

    # ------------------------------------------------------------ user access
    def _user_units(self, params: list[nn.Parameter]) -> list[int]:
        return sorted({self.plan.param_unit[id(p)] for p in params})

    def _gather_for_user(self, params: list[nn.Parameter]) -> None:
        self.gatherer.enter(self._user_units(params))

    def _release_for_user(self, params: list[nn.Parameter]) -> None:
        self.gatherer.leave(self._user_units(params), free=True)

    def _write_back(self, wanted: set[int]) -> None:
        """The wanted parameters' pieces into the master and the compute shard."""
        self._write_pieces_back(wanted, self._full_bucket)
        self._shards_from_masters()

    def _shards_from_masters(self) -> None:
        if not self._masters_are_parameters:  # else they are one storage already
            for shard, master in zip(self.param_shards, self.masters, strict=True):
                shard.copy_(master.detach())

    def _full_bucket(self, group: int, bucket: int) -> torch.Tensor:
        """The gathered full buffer of bucket ``bucket`` of ``group``."""
        unit, k = self._bucket_units[(group, bucket)]
        return unit.fulls[k]

    # --------------------------------------------------------------- reports
    def memory_report(self) -> MemoryReport:
        """As the other stages; ``parameters`` counts the compute shards, the persistent
        unit, the units gathered now and the frozen parameters."""
        trainable = set(self.plan.param_unit)
        fulls = [full for unit in self.gatherer.units for full in unit.fulls]
        frozen = [p for p in self.module.parameters() if id(p) not in trainable]
        return MemoryReport(
            parameters=tensor_bytes([*self.param_shards, *fulls, *frozen]),
            gradients=tensor_bytes(self._gradient_tensors()),
            master_weights=self._master_bytes(),
            optimizer_states=optimizer_state_bytes(self.optimizer),
            buffers=tensor_bytes(self.module.buffers()),
            comm_buffers=self.comm.buffers.bytes_held,
        )


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, list | tuple):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
