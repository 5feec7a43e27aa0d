"""The engine every stage shares: the training-step protocol, precision, scaling, clipping.

    engine = zero_core.initialize(model, torch.optim.AdamW(model.parameters()), config, comm)
    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()          # applies the update every gradient_accumulation_steps calls

One step, for every stage, in this order (the order is part of the bit-for-bit contract):

    per micro-step   loss * loss_scale -> backward -> gradients reduced across ranks in the
                     gradient dtype (the compute dtype, or config.reduce_dtype: each one cast
                     as it lands) in rank order when the communicator is deterministic, and
                     accumulated, in that dtype, over micro-steps
    at the boundary  g = float32(accumulated) / (V * accumulation_steps * loss_scale)
                     (V = N, or the virtual ranks of micro_batches_per_rank: slot_rows)
                     float16: if any rank sees inf/nan, skip the step on every rank
                     clipping: g *= max_norm / (norm + 1e-6) when that is < 1 (grad_norm)
                     optimizer.step() on float32 master weights (full, or this rank's shard)
                     compute parameters = master weights cast to the compute dtype
                     (delayed_parameter_update: the optimizer step runs in a background
                     thread and its values are published at the next step instead;
                     zero_core.delayed_update)

The engine runs this protocol only. Where each state lives and which collectives move it
is its components' business, chosen by the stage's frozen StagePolicy (stage_policy):

    Engine (its parts built in one place: builder.build_engine_parts)
      slots       ParamTable            one ParamSlot per trainable parameter (param_table)
      layouts     [GroupLayout]         per optimizer group: buckets, each rank's shard
      parameters  ReplicatedParameters  whole, views of bucket buffers (replicated_params)
                | ShardedParameters     this rank's shard, gathered per unit (sharded_params)
      gradients   AllReducedGradients   whole, all-reduced (allreduced_gradients)
                | ReduceScatteredGradients   this rank's slice (reduce_scattered_gradients)
      masters     MasterWeights         float32, this rank's shard; tiles the optimizer steps
      optimizer   the user's optimizer class over the master tiles
      loss_scaler LossScaler | NoLossScaler

A new placement (host or disk tiers for masters and optimizer states, a shard group
smaller than the data-parallel group) is another component chosen by the policy; see
docs/architecture.md.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from zero_comm.determinism import Fingerprint, current_fingerprint
from zero_comm.profiler_ranges import profiler_range

from . import grad_placeholders
from .builder import EngineParts, close_components
from .checkpoint.format import CheckpointError
from .checkpoint.loader import load as load_checkpoint
from .checkpoint.sharded_state import ShardedGroupState, ShardedState
from .checkpoint.tags import DEFAULT_TAG, check_tag, save_tagged
from .delayed_update import DelayedUpdate
from .forward_inputs import cast_floating
from .grad_norm import clip_coefficient, norm_from_row_sums
from .gradient_checks import (
    any_model_parallel_rank,
    divide_and_check_finite,
    first_nonfinite_message,
    model_parallel_rows,
)
from .initial_state import whole_tensors
from .memory.host_heap import StepHeapRelease, release_free_heap
from .memory.report import MemoryReport, tensor_bytes
from .reduced_gradient import GroupGradient, divide_away, pieces_of
from .stage_policy import ParameterPlacement
from .state_dict_reads import engine_reads


class BoundaryGradients(NamedTuple):
    """An accumulation boundary's gradients, ready for clipping and the optimizer."""

    gradients: list[GroupGradient]  # per group, float32, divided by N x steps x scale
    overflow: bool  # some rank (or model-parallel rank) saw inf/nan: the step is skipped


class Engine:
    """A model, its optimizer and a communicator, trained as one data-parallel replica."""

    def __init__(self, parts: EngineParts) -> None:
        """Takes what builder.build_engine_parts built and wired (zero_core.initialize
        does both); only the training loop's counters start here."""
        self.module = parts.module
        self.config = parts.config
        self.comm = parts.comm
        self.policy = parts.policy
        self.model_parallel = parts.model_parallel
        self.dtype = parts.config.param_dtype
        self.loss_scaler = parts.loss_scaler
        self.slots = parts.slots
        self.hybrid = parts.hybrid  # hybrid sharding's groups, or None
        self.shard_comm = parts.shard_comm  # the ranks the states are partitioned over
        self.secondary = parts.secondary  # hpZ: stage 3's backward gathers stay in it
        # Declared here, with their layouts; see component_contracts for when each is called.
        self.layouts = parts.layouts  # per group: buckets of a shard over N (stage 0: 1) ranks
        self.compute_params = parts.parameters  # compute params: whole views, or shard + gatherer
        self.gradients = parts.gradients  # whole all-reduced, or this rank's reduced slice
        self.masters = parts.masters  # float32 shard per group; tiles the optimizer steps
        self.optimizer = parts.optimizer
        # ZeroConfig.optimizer_in_backward: each bucket is stepped as backward reduces it.
        self.backward_stepper = parts.backward_stepper
        self._module_hooks = parts.module_hooks
        self.virtual_ranks = parts.virtual_ranks  # micro-batch slots per rank (virtual_ranks)
        self.slot_rows = parts.slot_rows  # holds the slots' gradients until the last one
        # ZeroConfig.delayed_parameter_update: step t's update runs while step t+1 computes.
        self.delayed_update = (
            DelayedUpdate(self.masters, self.dtype, self.comm.device, self.comm.rank,
                          self.config.offload_pin_memory)
            if self.config.delayed_parameter_update
            else None
        )  # fmt: skip
        self._closer = weakref.finalize(
            self, close_components, self.masters, self.compute_params, self.delayed_update
        )
        self._frozen = [not p.requires_grad for p in self.module.parameters()]
        self.micro_steps = 0
        self._boundary: BoundaryGradients | None = None  # this boundary's, once computed
        self._said_step_without_backward = False  # step() with nothing to apply: said once
        self.micro_step_label = ""
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        # A learning-rate scheduler over self.optimizer that step() advances after every
        # applied update (a DeepSpeed config's; or set your own); saved in checkpoints.
        self.lr_scheduler: Any = None
        self._step_heap_release = StepHeapRelease()
        if self._heap_release_on():
            release_free_heap()  # the build's temporaries (whole values, full buffers)

    # ----------------------------------------------------------- the module's API
    # Code written for DeepSpeed or DDP treats the engine as the model: these reach the
    # module (the engine's own components are compute_params, gradients, masters).
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (``module.parameters()``)."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's named parameters (``module.named_parameters()``)."""
        return self.module.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        """Set the module's training mode; returns the engine, as ``nn.Module.train`` does."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """The module in evaluation mode (``module.eval()``)."""
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the engine lacks: the module's attributes (a config, a
        # custom method), as DeepSpeed's engine forwards them.
        if name.startswith("__") or "module" not in self.__dict__:
            raise AttributeError(name)
        try:
            return getattr(self.__dict__["module"], name)
        except AttributeError:
            raise AttributeError(
                f"neither the engine nor its module ({type(self.__dict__['module']).__name__}) "
                f"has an attribute {name!r}"
            ) from None

    # ----------------------------------------------------------- parameters
    def trainable_parameters(self) -> Iterator[tuple[int, nn.Parameter]]:
        """(optimizer group, parameter) for every trainable parameter, in group order."""
        for slot in self.slots:
            yield slot.group, slot.param

    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers by state-dict name: what every rank holds whole
        at every stage (the trainable parameters are the engine's to lay out)."""
        return whole_tensors(self.module, self.slots)

    def tied_parameter_names(self) -> dict[str, str]:
        """A tied parameter's later names, each with the first name it shares storage with."""
        return dict(self.slots.names.aliases)

    # ----------------------------------------------------------- training step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; floating-point inputs are cast to the compute dtype first
        unless ``config.cast_forward_inputs`` is False."""
        if self.config.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.dtype)
        return self.module(*args, **kwargs)

    forward = __call__

    @property
    def is_accumulation_boundary(self) -> bool:
        return self.micro_steps == self.config.gradient_accumulation_steps

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for float16), then reduce this micro-step's gradients."""
        calls = self.slot_rows.calls(self.micro_steps)  # since the last step (slots count)
        if self.micro_steps >= self.config.gradient_accumulation_steps:
            raise RuntimeError(
                f"[rank {self.comm.rank}] backward called {calls + 1} times without step(); "
                f"{self.slot_rows.calls_per_step(self.config)}: call step() after each backward"
            )
        self._check_requires_grad()
        # Gradient collectives carry the micro-step in their label, so ranks configured
        # with different accumulation are named instead of summing mismatched gradients.
        self.micro_step_label = (
            f" (micro-step {self.micro_steps + 1} of {self.config.gradient_accumulation_steps})"
        )
        first = self.micro_steps == 0
        self.slot_rows.begin_slot()
        if self.backward_stepper is not None:
            self.backward_stepper.begin()  # raises before anything has begun
        grad_placeholders.remove(slot.param for slot in self.slots)
        self.gradients.before_backward(first, self.micro_step_label)
        self.compute_params.before_backward()
        try:
            scale = self.loss_scaler.scale
            (loss * scale if scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
            self.gradients.after_backward(first)
            if self.backward_stepper is not None:
                self.backward_stepper.finish(self.global_steps)
        finally:
            self.gradients.end_backward()
            self.compute_params.end_backward()
        if self.backward_stepper is not None:
            self.compute_params.publish()  # the update is whole now, not at step()
        if self.slot_rows.end_slot():  # the micro-step's last slot (virtual_ranks)
            self.micro_steps += 1
        grad_placeholders.place(slot.param for slot in self.slots)

    def _check_requires_grad(self) -> None:
        """The layout was made for the parameters trainable at initialize: a parameter
        frozen or unfrozen since would be trained wrongly (Adam keeps moving a frozen
        parameter on a zero gradient), so it is an error."""
        for (name, p), frozen in zip(self.module.named_parameters(), self._frozen, strict=True):
            if p.requires_grad == frozen:
                now = "True" if p.requires_grad else "False"
                raise RuntimeError(
                    f"[rank {self.comm.rank}] parameter {name} has requires_grad={now} now but "
                    f"not when zero_core.initialize laid the model out; freeze or unfreeze "
                    "parameters before initialize (or build a new engine)"
                )

    def step(self) -> bool:
        """Apply the update if this is an accumulation boundary; True if it was applied
        (False between boundaries, and when a NaN/Inf gradient on any rank skipped it)."""
        if not self.is_accumulation_boundary:
            # Every stage leaves .grad None outside engine.backward (stages 0 and 1:
            # allreduced_gradients.drop_grad_views), so a gradient here is a misuse.
            idle = self.slot_rows.calls(self.micro_steps) == 0  # no backward since the last step
            if idle and any(slot.param.grad is not None for slot in self.slots):
                raise RuntimeError(
                    f"[rank {self.comm.rank}] gradients are waiting in .grad but the engine "
                    "saw no backward: call engine.backward(loss), not loss.backward()"
                )
            if idle and not self._said_step_without_backward:
                self._said_step_without_backward = True
                if self.comm.rank == 0:
                    warnings.warn(
                        "engine.step() with no engine.backward(loss) since the last step: "
                        "nothing to apply, so nothing changed (said once)",
                        stacklevel=2,
                    )
            return False
        if self.backward_stepper is not None:  # backward stepped and published every bucket
            self.backward_stepper.check_options()
            self._applied()
            return True
        boundary = self._boundary_gradients()
        gradients = boundary.gradients
        if boundary.overflow:
            if self.dtype is not torch.float16 and self.config.nonfinite == "raise":
                raise FloatingPointError(
                    first_nonfinite_message(
                        self.module, self.slots, gradients, self.comm, self.global_steps
                    )
                )
            self.loss_scaler.update(overflow=True)  # a no-op unless float16
            self.skipped_steps += 1
            self.flush_update()  # nothing launched: the pending update is still published
            self.zero_grad()
            self._release_heap_after_step()
            return False
        if self.config.clip_grad_norm is not None:
            self._clip(gradients, self.config.clip_grad_norm)
        if self.delayed_update is not None:  # publish step t-1's update, launch step t's
            self.flush_update()
            held = self.gradients.tensors()
            self.delayed_update.launch(self.optimizer, gradients, held, self.global_steps + 1)
            self._applied()
            return True
        # Whole parameters are all-gathered bucket by bucket after the step: stepping the
        # masters bucket by bucket lets each gather start as soon as its bucket is stepped.
        self.masters.step(
            self.optimizer,
            gradients,
            self.compute_params.take_master_values,
            bucket_by_bucket=self.policy.parameters is ParameterPlacement.REPLICATED,
        )
        with profiler_range("publish"):
            self.compute_params.publish()
        self._applied()
        return True

    def flush_update(self) -> None:
        """With ``delayed_parameter_update``: wait for the update in flight and publish it
        to the compute parameters (the next forward sees every step taken); raises what
        the update raised. ``save`` does it; call it before touching ``optimizer``'s
        state. A no-op otherwise (zero_core.delayed_update)."""
        if self.delayed_update is not None:
            self.delayed_update.publish(
                self.compute_params.take_master_values, self.compute_params.publish
            )

    def wait_for_update(self) -> None:
        """With ``delayed_parameter_update``: wait for the update in flight (reads of the
        master weights and optimizer states come after it) and raise what it raised; its
        publish stays for the next step, so the run is unchanged. A no-op otherwise."""
        if self.delayed_update is not None:
            self.delayed_update.settle()

    def _boundary_gradients(self) -> BoundaryGradients:
        """This boundary's float32 gradients, divided by N x accumulation x loss scale,
        and whether any rank saw inf/nan in them: computed once per boundary (by
        clip_grad_norm_ or step, whichever comes first; collective at some stages)."""
        if self._boundary is None:
            denominator = float(self.virtual_ranks.total * self.config.gradient_accumulation_steps)
            denominator *= self.loss_scaler.scale
            gradients = self.gradients.float32_gradients()
            finite = divide_and_check_finite(
                (piece for g in gradients for piece in pieces_of(g)),
                denominator,
                self.config.bucket_numel,
            )
            finite = divide_away(gradients, denominator) and finite  # offloaded slices
            overflow = self.gradients.any_rank(not finite)
            if self.model_parallel is not None:
                overflow = any_model_parallel_rank(self.model_parallel, overflow)
            self._boundary = BoundaryGradients(gradients, overflow)
        return self._boundary

    def _clip(self, gradients: list[GroupGradient], max_norm: float) -> float:
        """Scale ``gradients`` so their global norm is at most ``max_norm`` (grad_norm:
        the same bits at every stage and world size); returns the norm before."""
        mp, row_sums = self.model_parallel, self.gradients.row_sums
        rows = (
            row_sums(gradients)
            if mp is None
            else model_parallel_rows(self.slots, gradients, mp, row_sums)
        )
        norm = norm_from_row_sums(rows)
        self.last_grad_norm = norm
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient is not None:
            for g in gradients:
                g.mul_(coefficient)
        return norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: clip this step's gradients to a global L2 norm of ``max_norm`` and
        return the norm before clipping, as FSDP's ``clip_grad_norm_`` and
        ``torch.nn.utils.clip_grad_norm_`` do. Call it after the last ``engine.backward``
        of the accumulation, before ``engine.step()``. The gradients are the reduced,
        unscaled float32 ones the step applies (``p.grad`` does not hold them: see
        grad_placeholders), so the norm is the same at every stage and world size. With
        float16 and an overflow the norm is inf (the step is then skipped)."""
        if norm_type != 2.0:
            raise ValueError(
                f"clip_grad_norm_(norm_type={norm_type}): only the L2 norm (2.0) is supported"
            )
        if not math.isfinite(max_norm) or max_norm <= 0:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): give a finite norm > 0")
        if self.backward_stepper is not None:
            raise RuntimeError(
                f"[rank {self.comm.rank}] clip_grad_norm_ with optimizer_in_backward: the "
                "step was applied during backward; set ZeroConfig(clip_grad_norm=...) instead"
            )
        if not self.is_accumulation_boundary:
            raise RuntimeError(
                f"[rank {self.comm.rank}] clip_grad_norm_ after {self.micro_steps} of "
                f"{self.config.gradient_accumulation_steps} engine.backward calls: call it "
                "after the last backward of the accumulation, just before engine.step()"
            )
        boundary = self._boundary_gradients()
        norm = math.inf if boundary.overflow else self._clip(boundary.gradients, max_norm)
        return torch.tensor(norm, dtype=torch.float32, device=self.comm.device)

    def _applied(self) -> None:
        """An update was applied: count it, advance the schedule, drop the gradients."""
        self.loss_scaler.update(overflow=False)
        self.global_steps += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        self._release_heap_after_step()

    def _heap_release_on(self) -> bool:
        """Whether free heap pages go back to the system: where the step's tensors live in
        host memory (ZeroConfig.release_host_heap)."""
        host = self.comm.device.type == "cpu" or bool(self.config.offloads)
        return self.config.release_host_heap and host

    def _release_heap_after_step(self) -> None:
        """Free heap pages back to the system if the heap has grown past the first steps'
        (zero_core.memory.host_heap.StepHeapRelease)."""
        if self._heap_release_on():
            self._step_heap_release.after_step()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (done automatically after every applied step)."""
        self.micro_steps = 0
        self.slot_rows.clear()
        self._boundary = None
        grad_placeholders.remove(slot.param for slot in self.slots)
        for p in self.module.parameters():
            if p.grad is not None and not self.gradients.grads_are_views:
                p.grad = None
        self.gradients.clear()

    # ------------------------------------------------------------ checkpoints
    def sharded_state(self) -> ShardedState:
        """This rank's part of the training state (see zero_core.checkpoint.sharded_state): views of
        the master weights and the optimizer's own state dicts, no copies."""
        self.wait_for_update()
        groups = []
        for g in range(len(self.masters.tiles)):
            master_tiles, tile_states = self.masters.group_state(g, self.optimizer)
            groups.append(
                ShardedGroupState(
                    params=[(slot.name, slot.shape) for slot in self.slots.by_group[g]],
                    pieces=self.masters.shard_pieces(g),
                    master_tiles=master_tiles,
                    tile_states=tile_states,
                    options={
                        k: v for k, v in self.optimizer.param_groups[g].items() if k != "params"
                    },
                )
            )
        return ShardedState(
            groups=groups,
            replicated=not self.policy.shard_optimizer_states,
            optimizer=type(self.optimizer).__name__,
            global_steps=self.global_steps,
            skipped_steps=self.skipped_steps,
            loss_scaler=self.loss_scaler.state_dict(),
            lr_scheduler=None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            stage=self.config.stage,
            param_dtype=self.dtype,
            fingerprint=self.fingerprint(),
            whole=self.whole_tensors(),
            aliases=self.tied_parameter_names(),
            first_replica=self.shard_comm.rank == self.comm.rank,
            shard_weights=self.layouts[0].weights if self.layouts else None,
        )

    def load_sharded_state(self, state: ShardedState) -> None:
        """Collective: continue from ``state``, laid out as :meth:`sharded_state` lays out
        this engine's (same groups, tiles and pieces). Master tiles that are not already
        this engine's own views are copied in; tile states become the optimizer's state;
        the parameters are then republished from the masters on every rank."""
        if len(state.groups) != len(self.masters.tiles):
            raise ValueError(
                f"a state of {len(state.groups)} optimizer groups cannot load into an engine "
                f"of {len(self.masters.tiles)}"
            )
        if self.delayed_update is not None:
            self.delayed_update.discard()  # the loaded masters are published below
        with torch.no_grad():
            for g, group in enumerate(state.groups):
                self.masters.load_group_state(
                    g, group.master_tiles, group.tile_states, self.optimizer
                )
                self.optimizer.param_groups[g].update(group.options)
        self.global_steps = state.global_steps
        self.skipped_steps = state.skipped_steps
        self.loss_scaler.load_state_dict(state.loss_scaler)
        if self.lr_scheduler is not None and state.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)
        self.zero_grad()
        self.masters.visit(self.compute_params.take_master_values)
        self.compute_params.publish()

    def save(
        self,
        path: str | os.PathLike[str],
        extra: dict[str, Any] | None = None,
        *,
        tag: str | None = None,
        keep_last: int | None = None,
        arrival_timeout: float | None = None,
    ) -> Path:
        """Collective: write a sharded checkpoint to ``path/<tag>/`` (default tag
        ``global_step<N>``) atomically, then point ``path/latest`` at it; every other file
        in ``path`` is left alone (zero_core.checkpoint.tags). ``keep_last=K`` removes this
        folder's older checkpoints beyond the newest K. ``extra`` (JSON values, e.g. the
        data position) comes back from :meth:`load`. Call it after ``step()``, on every
        rank: a rank that exited without calling it is named within seconds; one alive
        elsewhere is named after ``arrival_timeout`` seconds (default: the communicator's
        timeout, with a warning naming it after a minute); a rank that is only late by
        less saves as usual. Returns the checkpoint's folder."""
        if calls := self.slot_rows.calls(self.micro_steps):
            raise RuntimeError(
                f"[rank {self.comm.rank}] save() after {calls} backward calls "
                "without step(): save at an accumulation boundary, after step()"
            )
        if self.model_parallel is not None and self.model_parallel.comm.world_size > 1:
            # Every data-parallel group would write its own slices into one folder under
            # the same file names: refused, never a checkpoint mixed from two of them.
            raise CheckpointError(
                f"[rank {self.comm.rank}] save() of a tensor-parallel engine "
                f"({self.model_parallel.comm.world_size} model-parallel ranks) is not "
                "supported yet: checkpoints hold data-parallel shards only"
            )
        self.flush_update()  # the checkpoint holds every step taken; the next forward too
        tag = DEFAULT_TAG.format(steps=self.global_steps) if tag is None else tag
        return save_tagged(
            self.sharded_state(), self.comm, Path(path), tag, extra, keep_last, arrival_timeout
        )

    def load(self, path: str | os.PathLike[str], *, tag: str | None = None) -> dict[str, Any]:
        """Collective: restore the state saved at ``path`` by any world size and stage:
        the checkpoint ``path/latest`` names, ``path/<tag>`` with ``tag``, or ``path``
        itself when it is one checkpoint (as saved before tags). Returns the ``extra``
        given to :meth:`save`. Raises CheckpointError naming the file for a missing,
        corrupt or mismatched checkpoint."""
        if tag is not None:
            check_tag(tag)
        folder = Path(path) if tag is None else Path(path) / tag
        state = self.sharded_state()
        extra = load_checkpoint(state, self.comm, folder)  # fills the state's views in place
        self.load_sharded_state(state)
        return extra

    def fingerprint(self) -> Fingerprint:
        """What this rank's bits depend on now (torch build, BLAS, CPU, threads, ...): two
        runs are bitwise equal only under equal fingerprints (zero_comm.determinism)."""
        return current_fingerprint(self.comm.device)

    # ------------------------------------------------------------ user access
    @contextmanager
    def gathered_parameters(
        self,
        params: Sequence[nn.Parameter] | None = None,
        *,
        modify: bool = False,
        modifier_rank: int | None = None,
    ) -> Iterator[None]:
        """Collective: the whole values of ``params`` (default: every trainable parameter)
        in the compute dtype, on every rank, inside the block; for reading or, with
        ``modify``, for changing. Stage 3 gathers them for the block; the other stages
        hold them whole anyway, so the same code runs at every stage.

            with engine.gathered_parameters([model.lm_head.weight], modify=True):
                model.lm_head.weight.zero_()

        With ``modify``, each rank writes its part of those parameters (and nothing else:
        the float32 master values of the others are untouched) back into the master
        weights on exit; with ``modifier_rank``, that rank's values are broadcast first
        (a modifier rank means ``modify``, as in DeepSpeed's ``GatheredParameters``).
        Without ``modify`` the values are for reading: changes are not kept (stage 3
        drops them on exit, the others at the next step; but float32 parameters at stages
        0-2 are master weights, so do not change them there without ``modify``)."""
        modify = modify or modifier_rank is not None  # as DeepSpeed's GatheredParameters
        self.flush_update()  # the parameters of every step taken, and masters to write to
        every = list(self.slots)
        wanted = every if params is None else [s for s in map(self.slots.get, params) if s]
        self.compute_params.gather_for_user(wanted)
        try:
            yield
            if modify:
                if modifier_rank is not None:
                    for slot in wanted:
                        self.comm.broadcast(slot.param.data, src=modifier_rank)
                self.masters.write_back(wanted, self.compute_params.full_bucket)
                self.compute_params.after_write_back(self.masters)
        finally:
            self.compute_params.release_for_user(wanted)

    # ---------------------------------------------------------------- reports
    @property
    def stats(self) -> Any:
        """The communicator's statistics (calls and ring-convention volume per collective)."""
        return self.comm.stats

    def full_state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """Collective: the full float32 model state keyed like ``module.state_dict()``.

        Trainable parameters come from the master weights; frozen parameters and floating
        buffers are converted to float32. With ``rank`` given, only that rank gets the dict
        (the others get an empty one)."""
        self.wait_for_update()
        masters = self.masters.full_values(self.shard_comm, self.slots)
        if rank is not None and rank != self.comm.rank:
            return {}
        result: dict[str, torch.Tensor] = {}
        with engine_reads():  # names and frozen values; masters give the rest
            entries = self.module.state_dict(keep_vars=True).items()
        for name, value in entries:
            slot = self.slots.get(value)
            if slot is not None:
                result[name] = masters[slot.index].clone()
            elif value.is_floating_point():
                result[name] = value.detach().to(torch.float32, copy=True)
            else:
                result[name] = value.detach().clone()
        return result

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds now, by category (views of one storage count once). With
        float32 parameters the master weights are the parameters (stage 0), this rank's
        slice of them (stages 1 and 2) or the compute shard (stage 3), and count once,
        under ``parameters``; at stage 3 ``parameters`` counts the compute shards, the
        persistent unit, the units gathered now and the frozen parameters. ``gradients``
        counts what the step holds: at stages 2 and 3 (and 1 with accumulation) the
        gradient shard has storage only from backward to the step (shard_gradient.py).
        Offloaded gradient slices (``offload_gradients``) count under ``host`` (their
        accumulators) or ``disk`` (their blocks in the swap files); ``gradients`` then
        counts only the most of them landed on the device at once, and
        ``gradients_in_flight`` the device bound of their way out (offload.gradient_tier)."""
        self.wait_for_update()  # the update in flight creates and swaps optimizer states
        device_states, host, disk = self.masters.tier_bytes(self.optimizer)
        host += self.compute_params.host_bytes + self.gradients.host_bytes
        disk += self.compute_params.disk_bytes
        return MemoryReport(
            parameters=tensor_bytes(self.compute_params.report_tensors(self.module)),
            gradients=self.gradients.step_bytes()
            if self.backward_stepper is None
            else self.backward_stepper.held_bytes(),
            master_weights=self.masters.bytes,
            optimizer_states=device_states,
            buffers=tensor_bytes(self.module.buffers()),
            comm_buffers=self.comm.buffers.bytes_held,
            host=host,
            disk=disk,
            gradients_in_flight=self.gradients.in_flight_bytes(),
            slot_copies=self.slot_rows.peak_bytes,
        )

    def close(self) -> None:
        """Remove this engine's swap files and stop their I/O threads (also done when
        the engine is garbage-collected, and at interpreter exit)."""
        grad_placeholders.remove(slot.param for slot in self.slots)
        self._closer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (its parameters are then the user's again)."""
        return not self._closer.alive


# The name this class had before the engine became one class (kept: it is public API).
ZeroEngine = Engine
