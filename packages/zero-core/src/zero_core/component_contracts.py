"""The contracts between the engine and its three components, and when each call comes.

The engine runs the step protocol (engine.py); its StagePolicy chooses, and builder.py
builds, one component of each kind:

    parameters  ParameterComponent  replicated_params.ReplicatedParameters (stages 0-2)
                                    sharded_params.ShardedParameters (stage 3)
    gradients   GradientComponent   allreduced_gradients.AllReducedGradients (stage 0)
                                    reduce_scattered_gradients.ReduceScatteredGradients
    masters     MasterComponent     master_weights.MasterWeights (on the device)
                                    offload.masters.OffloadedMasters (host, disk)

When each method is called, in the order the engine calls it:

    build        parameters.fill(slot, v) + masters.fill(slot, v)   per slot, rank 0's values
                 parameters.finish_build(); masters.finish_fill()
    backward     gradients.before_backward(first, label); parameters.before_backward()
                   loss.backward(): gradient hooks reduce buckets; a reduce-scattering
                   component tells parameters.gradient_arrived(slot) for each gradient
                 gradients.after_backward(first)
                 finally: gradients.end_backward(); parameters.end_backward()
    step         gradients.float32_gradients(); gradients.any_rank(overflow);
                 gradients.row_sums(g) (clipping only)
                 masters.step(optimizer, g, parameters.take_master_values, ...)
                 parameters.publish(); then zero_grad: gradients.clear()
    user access  parameters.gather_for_user(slots) ... masters.write_back(slots,
                 parameters.full_bucket); parameters.after_write_back(masters) ...
                 parameters.release_for_user(slots)
    checkpoints  masters.group_state / shard_pieces; load: masters.load_group_state, then
                 masters.visit(parameters.take_master_values); parameters.publish()
    reports      parameters.report_tensors / host_bytes / disk_bytes / backward_head_numel;
                 gradients.step_bytes(); masters.bytes / tier_bytes(optimizer)
    close        masters.close(); parameters.close()   (the engine's finalizer; once)

Every call is made on every rank in the same order, and every collective a method runs is
issued in the same order on every rank: the components may assume both. A component that
has nothing to do at one of these points says so once, in a base class named for why
(``ParametersAlwaysWhole``), not in a method per point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from zero_comm import Communicator

from .checkpoint.sharded_state import MasterPiece
from .master_weights import Tile, TileVisitor, VisitsTiles
from .param_table import ParamSlot
from .reduced_gradient import GroupGradient


class ParameterComponent(Protocol):
    """The compute parameters: whole on every rank, or this rank's shard gathered per unit.

    After ``finish_build`` and after every ``publish``, every parameter the forward reads
    holds the current values in the compute dtype (stage 3: once its unit is gathered)."""

    @property
    def host_bytes(self) -> int:
        """Bytes of compute shards in host memory (offload_params="cpu")."""
        ...

    @property
    def disk_bytes(self) -> int:
        """Bytes of compute shards in swap files (offload_params="nvme")."""
        ...

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Build: ``value`` is the whole initial value of ``slot`` (rank 0's, any dtype);
        keep what this rank holds of it. Called once per slot, in slot order."""
        ...

    def finish_build(self) -> None:
        """Build: every slot was filled; parameters are ready for the first forward."""
        ...

    def reduce_order(self) -> tuple[list[int], list[str]] | None:
        """Build: the order gradient buckets should be reduced in (stage 3 follows its
        units' backward order: bucket indices and why), or None for layout order."""
        ...

    def before_backward(self) -> None:
        """Before ``loss.backward()`` of every micro-step (stage 3 arms its gathers)."""
        ...

    def gradient_arrived(self, slot: ParamSlot) -> None:
        """During backward: ``slot``'s gradient was taken by the gradient component, so its
        parameter is no longer needed for this backward (stage 3 may free its unit)."""
        ...

    def end_backward(self) -> None:
        """After backward, also when it raised: nothing may stay gathered for it."""
        ...

    def take_master_values(self, group: int, start: int, values: torch.Tensor) -> None:
        """Step or load: float32 ``values`` are the updated master elements
        ``[start, start + len)`` of ``group`` on this rank (a TileVisitor); cast them into
        the compute parameters. May launch collectives; ``publish`` finishes them."""
        ...

    def publish(self) -> None:
        """After every tile was taken: collective; the parameters hold the new values."""
        ...

    def full_bucket(self, group: int, bucket: int) -> torch.Tensor:
        """User access: the whole compute-dtype buffer of ``bucket`` of ``group``, valid
        between ``gather_for_user`` and ``release_for_user`` of its slots."""
        ...

    def gather_for_user(self, slots: list[ParamSlot]) -> None:
        """Collective: ``slots``' parameters are whole until ``release_for_user``."""
        ...

    def after_write_back(self, masters: VisitsTiles) -> None:
        """The user changed gathered values and ``masters`` holds them now: make every
        rank's compute parameters agree with the masters."""
        ...

    def release_for_user(self, slots: list[ParamSlot]) -> None:
        """Collective: the end of a ``gather_for_user`` block (also when it raised)."""
        ...

    def report_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """The tensors the memory report counts as parameters, now."""
        ...

    def backward_head_numel(self) -> int:
        """Elements kept gathered from the end of forward into backward (stage 3's backward
        head), so not gathered again: what a traffic report subtracts."""
        ...

    def close(self) -> None:
        """Remove swap files and stop I/O threads; called once, by the finalizer."""
        ...


class ParametersAlwaysWhole:
    """Parameters every rank holds whole, on the device, for the whole run (stages 0-2):
    nothing to gather for backward or for the user, no unit to free when a gradient
    arrives, values the user writes are already in place, no tier, nothing to close.

    The points of ParameterComponent where such parameters have nothing to do, said once."""

    host_bytes = 0
    disk_bytes = 0

    def before_backward(self) -> None:
        return None

    def gradient_arrived(self, slot: ParamSlot) -> None:
        return None

    def end_backward(self) -> None:
        return None

    def gather_for_user(self, slots: list[ParamSlot]) -> None:
        return None

    def after_write_back(self, masters: VisitsTiles) -> None:
        return None

    def release_for_user(self, slots: list[ParamSlot]) -> None:
        return None

    def backward_head_numel(self) -> int:
        return 0

    def reduce_order(self) -> tuple[list[int], list[str]] | None:
        """No unit order for the gradient buckets to follow (stage 3 has one)."""
        return None

    def close(self) -> None:
        return None


class GradientComponent(Protocol):
    """The gradients: reduced across ranks during backward, held until the step.

    ``grads_are_views``: from backward to the step ``p.grad`` is a view of the
    component's buffer (zero_grad then leaves ``.grad`` alone)."""

    grads_are_views: bool

    def before_backward(self, first_micro_step: bool, label: str) -> None:
        """Before ``loss.backward()``; ``label`` names the micro-step in collective labels
        (ranks configured differently are named instead of summing mismatched buckets)."""
        ...

    def after_backward(self, first_micro_step: bool) -> None:
        """After ``loss.backward()`` returned: launch what the hooks did not, wait for all;
        this micro-step's gradients are reduced and accumulated."""
        ...

    def end_backward(self) -> None:
        """After backward, also when it raised: no hook stays armed."""
        ...

    def float32_gradients(self) -> list[GroupGradient]:
        """At the boundary: per group, this rank's reduced gradient in float32, laid out
        like the group's master (the step divides and clips it in place)."""
        ...

    def row_sums(self, gradients: list[GroupGradient]) -> torch.Tensor:
        """grad_norm's row sums of ``gradients``, over every rank (a collective when the
        gradients are partitioned)."""
        ...

    def any_rank(self, flag: bool) -> bool:
        """Collective when the gradients are partitioned: ``flag`` on any rank."""
        ...

    def clear(self) -> None:
        """After the step (or a skipped one): the next micro-step starts from zero."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The component's gradient buffers (for memory accounting)."""
        ...

    def step_bytes(self) -> int:
        """The gradient bytes held on the device at the step."""
        ...

    @property
    def host_bytes(self) -> int:
        """Bytes of gradients offloaded to host memory (offload_gradients)."""
        ...

    def in_flight_bytes(self) -> int:
        """The device bound of offloaded gradients on their way out; 0 when none are."""
        ...


class MasterComponent(Protocol):
    """This rank's float32 master weights and the optimizer's tensors over them, in tiles.

    ``tiles[g]``: group g's tiles, each (the tensor the optimizer steps, where it sits in
    the group's flat master), covering the master in order."""

    tiles: list[list[Tile]]

    def fill(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Build: keep this rank's part of ``slot``'s whole initial value in float32."""
        ...

    def finish_fill(self) -> None:
        """Build: every slot was filled (the disk tier flushes its last blocks)."""
        ...

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: list[GroupGradient],
        updated: TileVisitor,
        *,
        bucket_by_bucket: bool = False,
    ) -> None:
        """Step ``optimizer`` over every tile with ``gradients`` (float32, per group, laid
        out like the master) and hand each tile's new values to ``updated``."""
        ...

    def visit(self, updated: TileVisitor) -> None:
        """Hand every tile's current values to ``updated`` (after a load or a write-back)."""
        ...

    def write_back(
        self, slots: Iterable[ParamSlot], full_bucket: Callable[[int, int], torch.Tensor]
    ) -> None:
        """Copy this rank's part of ``slots``' whole compute values (in ``full_bucket``)
        into the master."""
        ...

    def full_values(self, comm: Communicator, slots: Iterable[ParamSlot]) -> list[torch.Tensor]:
        """Collective over ``comm``: each slot's whole float32 value, on every rank."""
        ...

    def shard_pieces(self, group: int) -> list[MasterPiece]:
        """Where each parameter's elements sit in this rank's master of ``group``."""
        ...

    def group_state(
        self, group: int, optimizer: torch.optim.Optimizer
    ) -> tuple[list[Tile], list[dict[str, Any]]]:
        """Views of ``group``'s master tiles (flat) and the optimizer's state of each."""
        ...

    def load_group_state(
        self,
        group: int,
        master_tiles: list[Tile],
        tile_states: list[dict[str, Any]],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Take ``group``'s master values and the optimizer's state from a checkpoint
        (laid out as ``group_state`` lays them out)."""
        ...

    @property
    def bytes(self) -> int:
        """Bytes of master weights on the device."""
        ...

    def tier_bytes(self, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
        """Optimizer-state bytes (device, host, disk)."""
        ...

    def close(self) -> None:
        """Remove swap files and stop I/O threads; called once, by the finalizer."""
        ...
