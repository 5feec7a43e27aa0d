"""The part of :class:`~zero_core.engine.Engine` that takes its training state out and
puts it back in; engine.py keeps the step protocol.

    sharded_state() / load_sharded_state(state)   this rank's part, as views (no copies)
    save(path) / load(path)                        a tagged, sharded checkpoint (collective)
    full_state_dict(rank)                          the whole float32 model (collective)
    gathered_parameters(params, modify=...)        whole parameters for a block (collective)
    fingerprint()                                  what this rank's bits depend on

Every stage goes through the same calls: the masters component lays out the float32
shards and optimizer states, compute_params publishes them back to the parameters.
:class:`EngineState` is a base of Engine, as zero_comm's ObjectCollectives is of
Communicator; the attributes and methods it uses are Engine's, declared below.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zero_comm import Communicator
from zero_comm.determinism import Fingerprint, current_fingerprint

from .checkpoint.format import CheckpointError
from .checkpoint.loader import load as load_checkpoint
from .checkpoint.sharded_state import ShardedGroupState, ShardedState
from .checkpoint.tags import DEFAULT_TAG, check_tag, save_tagged
from .component_contracts import MasterComponent, ParameterComponent
from .config.zero_config import ZeroConfig
from .delayed_update import DelayedUpdate
from .group_layout import GroupLayout
from .initial_state import whole_tensors
from .loss_scaler import LossScaler, NoLossScaler
from .model_parallel import ModelParallel
from .param_table import ParamTable
from .slot_rows import SlotRows
from .stage_policy import StagePolicy
from .state_dict_reads import engine_reads


class EngineState:
    """Checkpoints, the full state dict and gathered parameters of an Engine."""

    # Engine's attributes (set in Engine.__init__ from builder.EngineParts).
    module: nn.Module
    config: ZeroConfig
    comm: Communicator
    policy: StagePolicy
    model_parallel: ModelParallel | None
    dtype: torch.dtype
    loss_scaler: LossScaler | NoLossScaler
    slots: ParamTable
    shard_comm: Communicator
    layouts: list[GroupLayout]
    compute_params: ParameterComponent
    masters: MasterComponent
    optimizer: torch.optim.Optimizer
    slot_rows: SlotRows
    delayed_update: DelayedUpdate | None
    micro_steps: int
    global_steps: int
    skipped_steps: int
    lr_scheduler: Any

    if TYPE_CHECKING:  # the step protocol's, defined by Engine

        def flush_update(self) -> None: ...

        def wait_for_update(self) -> None: ...

        def zero_grad(self) -> None: ...

    # ------------------------------------------------------------ names
    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers by state-dict name: what every rank holds whole
        at every stage (the trainable parameters are the engine's to lay out)."""
        return whole_tensors(self.module, self.slots)

    def tied_parameter_names(self) -> dict[str, str]:
        """A tied parameter's later names, each with the first name it shares storage with."""
        return dict(self.slots.names.aliases)

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

    # ------------------------------------------------------------ whole model
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
