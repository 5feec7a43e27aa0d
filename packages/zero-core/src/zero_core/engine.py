"""The engine every stage shares: the training-step protocol, precision, scaling, clipping.

    engine = zero_core.initialize(model, torch.optim.AdamW(model.parameters()), config, comm)
    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()          # applies the update every gradient_accumulation_steps calls

One step, for every stage, in this order (the order is part of the bit-for-bit contract):

    per micro-step   loss * loss_scale -> backward -> gradients reduced across ranks in the
                     compute dtype (rank order when the communicator is deterministic) and
                     accumulated, in the compute dtype, over micro-steps
    at the boundary  g = float32(accumulated) / (N * accumulation_steps * loss_scale)
                     float16: if any rank sees inf/nan, skip the step on every rank
                     clipping: g *= max_norm / (norm + 1e-6) when that is < 1 (grad_norm)
                     optimizer.step() on float32 master weights (full, or this rank's shard)
                     compute parameters = master weights cast to the compute dtype

Subclasses hold the policy of their stage: where gradients and master weights live, and
which collectives move them.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zero_comm import Communicator, ReduceOp
from zero_comm.determinism import Fingerprint, current_fingerprint

from .config import ZeroConfig
from .flat_layout import Range
from .forward_inputs import cast_floating
from .grad_norm import clip_coefficient, norm_from_row_sums
from .init_values import InitValues, materialise, named_init_values
from .loss_scaler import LossScaler, NoLossScaler
from .memory import MemoryReport, optimizer_state_bytes, tensor_bytes
from .model_parallel import ModelParallel
from .optimizer_spec import ParamGroups
from .sharded_state import ShardedGroupState, ShardedState, ShardPiece


class ZeroEngine(abc.ABC):
    """A model, its optimizer and a communicator, trained as one data-parallel replica."""

    def __init__(
        self,
        module: nn.Module,
        groups: ParamGroups,
        config: ZeroConfig,
        comm: Communicator,
        model_parallel: ModelParallel | None = None,
        init_values: InitValues | None = None,
    ) -> None:
        self.model_parallel = model_parallel
        self._init_values = init_values
        self.module = module
        self.config = config
        self.comm = comm
        self.groups = groups
        self.dtype = config.param_dtype
        self.loss_scaler: LossScaler = (
            LossScaler(
                config.loss_scale or config.initial_loss_scale,
                dynamic=config.loss_scale == 0,
                window=config.loss_scale_window,
                hysteresis=config.hysteresis,
                minimum=config.min_loss_scale,
            )
            if self.dtype is torch.float16
            else NoLossScaler()
        )
        self.micro_steps = 0
        self.micro_step_label = ""
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        # A learning-rate scheduler over self.optimizer that step() advances after every
        # applied update (a DeepSpeed config's; or set your own); saved in checkpoints.
        self.lr_scheduler: Any = None
        initial = self._take_initial_state()
        self._init_values = None  # consumed; do not keep the caller's tensors alive
        self._frozen = [not p.requires_grad for p in self.module.parameters()]
        self._cast_module()
        # Per group, the float32 tensor holding this rank's master weights; empty where
        # they are no one tensor (float32 parameters at stages 1 and 2: this rank's slice
        # of each parameter bucket). ``master_pieces``, the tensors the optimizer steps,
        # tile each group's master in order at every stage.
        self.masters = self._build(initial)
        self.master_pieces = self._master_pieces()
        self.optimizer = groups.build(
            [[piece for piece, _ in pieces] for pieces in self.master_pieces]
        )

    # ----------------------------------------------------------- stage policy
    @abc.abstractmethod
    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Lay out parameters and gradients; return the float32 master tensor of each group
        (none where the master is no one tensor; see ``masters``).

        ``initial`` maps id(parameter) to its float32 value, identical on every rank."""

    def _master_pieces(self) -> list[list[tuple[torch.Tensor, slice]]]:
        """Per group, the tensors the optimizer steps and where each sits in the group's
        master, in order, covering it: here the whole master. Partitioned stages cut it at
        bucket boundaries so the optimizer's temporaries are bounded by the bucket size,
        not the model."""
        return [[(master, slice(0, master.numel()))] for master in self.masters]

    def _before_backward(self, first_micro_step: bool) -> None:
        """Called just before autograd runs (stage 2 arms its gradient hooks here)."""
        return None

    @abc.abstractmethod
    def _reduce_gradients(self, first_micro_step: bool) -> None:
        """After a backward: reduce this micro-step's gradients and accumulate them."""

    @abc.abstractmethod
    def _float32_gradients(self) -> list[torch.Tensor]:
        """Per group, the accumulated gradient matching that group's master tensor, as a
        new float32 tensor."""

    @abc.abstractmethod
    def _row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """The grad_norm row sums of the whole (all ranks') gradient, in parameter order."""

    @abc.abstractmethod
    def _param_ranges(self, group: int) -> list[tuple[nn.Parameter, slice]]:
        """Where each parameter's elements sit in this rank's gradient of ``group``."""

    @abc.abstractmethod
    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (the same answer on every rank)."""

    @abc.abstractmethod
    def _publish_parameters(self) -> None:
        """Copy the updated master weights into the compute parameters of every rank."""

    @abc.abstractmethod
    def _clear_gradients(self) -> None:
        """Forget accumulated gradients."""

    @abc.abstractmethod
    def _full_master_values(self) -> dict[int, torch.Tensor]:
        """Collective: id(parameter) -> its full float32 master value, on every rank."""

    @abc.abstractmethod
    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        """The gradient storage this rank holds, for the memory report."""

    # ----------------------------------------------------------- shared set-up
    def trainable_parameters(self) -> Iterator[tuple[int, nn.Parameter]]:
        for g, params in enumerate(self.groups.params):
            for p in params:
                yield g, p

    def _take_initial_state(self) -> dict[int, torch.Tensor]:
        """Rank 0's parameters and buffers on every rank (after ``init_values``, if given,
        filled them in); float32 copies of the trainables."""
        if self._init_values is not None:
            for _, tensor, value in named_init_values(self.module, self._init_values):
                materialise(tensor, value, self.comm.device)
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            data = tensor.data
            if not data.is_contiguous():
                data = data.contiguous()
                tensor.data = data
            self.comm.broadcast(data, src=0)
        return {
            id(p): p.detach().to(torch.float32, copy=True) for _, p in self.trainable_parameters()
        }

    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers by state-dict name: what every rank holds whole
        at every stage (the trainable parameters are the engine's to lay out)."""
        trainable = {id(p) for _, p in self.trainable_parameters()}
        out: dict[str, torch.Tensor] = {
            name: p for name, p in self.module.named_parameters() if id(p) not in trainable
        }
        out.update(self.module.named_buffers())
        return out

    def _cast_module(self) -> None:
        """Parameters and floating buffers to the compute dtype."""
        self.module.to(self.dtype)

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
        if self.micro_steps >= self.config.gradient_accumulation_steps:
            raise RuntimeError(
                f"[rank {self.comm.rank}] backward called {self.micro_steps + 1} times without "
                f"step(); with gradient_accumulation_steps="
                f"{self.config.gradient_accumulation_steps} call step() after each backward"
            )
        self._check_requires_grad()
        # Gradient collectives carry the micro-step in their label, so ranks configured
        # with different accumulation are named instead of summing mismatched gradients.
        self.micro_step_label = (
            f" (micro-step {self.micro_steps + 1} of {self.config.gradient_accumulation_steps})"
        )
        self._before_backward(first_micro_step=self.micro_steps == 0)
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        self._reduce_gradients(first_micro_step=self.micro_steps == 0)
        self.micro_steps += 1

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
            if (
                self.micro_steps == 0
                and not self._keeps_grad_views
                and any(p.grad is not None for _, p in self.trainable_parameters())
            ):
                raise RuntimeError(
                    f"[rank {self.comm.rank}] gradients are waiting in .grad but the engine "
                    "saw no backward: call engine.backward(loss), not loss.backward()"
                )
            return False
        denominator = float(self.comm.world_size * self.config.gradient_accumulation_steps)
        denominator *= self.loss_scaler.scale
        gradients = self._float32_gradients()
        for g in gradients:
            g.div_(denominator)
        finite = all(all_finite(g, self.config.bucket_numel) for g in gradients)
        overflow = self._any_rank(not finite)
        if self.model_parallel is not None:
            overflow = self._any_model_parallel_rank(overflow)
        if overflow:
            if self.dtype is not torch.float16 and self.config.nonfinite == "raise":
                raise FloatingPointError(self._first_nonfinite(gradients))
            self.loss_scaler.update(overflow=True)  # a no-op unless float16
            self.skipped_steps += 1
            self.zero_grad()
            return False
        if self.config.clip_grad_norm is not None:
            self.last_grad_norm = norm_from_row_sums(self._global_row_sums(gradients))
            coefficient = clip_coefficient(self.last_grad_norm, self.config.clip_grad_norm)
            if coefficient is not None:
                for g in gradients:
                    g.mul_(coefficient)
        for pieces, g in zip(self.master_pieces, gradients, strict=True):
            for piece, where in pieces:
                piece.grad = g[where]
        self.optimizer.step()
        for pieces in self.master_pieces:
            for piece, _ in pieces:
                piece.grad = None
        self._publish_parameters()
        self.loss_scaler.update(overflow=False)
        self.global_steps += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        """Drop accumulated gradients (done automatically after every applied step)."""
        self.micro_steps = 0
        for p in self.module.parameters():
            if p.grad is not None and not self._keeps_grad_views:
                p.grad = None
        self._clear_gradients()

    _keeps_grad_views = False

    # ------------------------------------------------------------ checkpoints
    _replicated_master = False  # stage 0: every rank holds the same master and states

    @abc.abstractmethod
    def _shard_pieces(self, group: int) -> list[tuple[int, Range, int]]:
        """The parameter pieces in this rank's master of ``group``: (parameter index in
        the group, element range of that parameter, offset in the master)."""

    def sharded_state(self) -> ShardedState:
        """This rank's part of the training state (see zero_core.sharded_state): views of
        the master weights and the optimizer's own state dicts, no copies."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        groups = []
        for g, tiles in enumerate(self.master_pieces):
            groups.append(
                ShardedGroupState(
                    params=[(names[id(p)], tuple(p.shape)) for p in self.groups.params[g]],
                    pieces=[ShardPiece(i, r, at) for i, r, at in self._shard_pieces(g)],
                    master_tiles=[(tile.detach().view(-1), where) for tile, where in tiles],
                    tile_states=[self.optimizer.state.get(tile, {}) for tile, _ in tiles],
                    options={
                        k: v for k, v in self.optimizer.param_groups[g].items() if k != "params"
                    },
                )
            )
        return ShardedState(
            groups=groups,
            replicated=self._replicated_master,
            optimizer=type(self.optimizer).__name__,
            global_steps=self.global_steps,
            skipped_steps=self.skipped_steps,
            loss_scaler=self.loss_scaler.state_dict(),
            lr_scheduler=None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
        )

    def load_sharded_state(self, state: ShardedState) -> None:
        """Collective: continue from ``state``, laid out as :meth:`sharded_state` lays out
        this engine's (same groups, tiles and pieces). Master tiles that are not already
        this engine's own views are copied in; tile states become the optimizer's state;
        the parameters are then republished from the masters on every rank."""
        if len(state.groups) != len(self.master_pieces):
            raise ValueError(
                f"a state of {len(state.groups)} optimizer groups cannot load into an engine "
                f"of {len(self.master_pieces)}"
            )
        with torch.no_grad():
            for g, (group, tiles) in enumerate(zip(state.groups, self.master_pieces, strict=True)):
                if len(group.master_tiles) != len(tiles) or len(group.tile_states) != len(tiles):
                    raise ValueError(
                        f"group {g}: {len(group.master_tiles)} master tiles and "
                        f"{len(group.tile_states)} tile states given for {len(tiles)} tiles"
                    )
                for (source, _), (tile, _) in zip(group.master_tiles, tiles, strict=True):
                    target = tile.detach().view(-1)
                    if source.shape != target.shape:
                        raise ValueError(
                            f"group {g}: a master tile of {source.numel()} elements given "
                            f"for one of {target.numel()}"
                        )
                    if source.data_ptr() != target.data_ptr():
                        target.copy_(source)
                for (tile, _), tile_state in zip(tiles, group.tile_states, strict=True):
                    if tile_state:
                        self.optimizer.state[tile] = dict(tile_state)
                    else:
                        self.optimizer.state.pop(tile, None)
                self.optimizer.param_groups[g].update(group.options)
        self.global_steps = state.global_steps
        self.skipped_steps = state.skipped_steps
        self.loss_scaler.load_state_dict(state.loss_scaler)
        if self.lr_scheduler is not None and state.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state.lr_scheduler)
        self.zero_grad()
        self._publish_parameters()

    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Collective: write a sharded checkpoint to directory ``path``, atomically (see
        zero_core.checkpoint). ``extra`` (JSON values, e.g. the data position) comes back
        from :meth:`load`. Call it after ``step()``."""
        from .checkpoint import save

        save(self, path, extra)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Collective: restore the state saved at ``path`` by any world size and stage;
        returns the ``extra`` given to :meth:`save`. Raises CheckpointError naming the
        file for a missing, corrupt or mismatched checkpoint."""
        from .checkpoint import load

        return load(self, path)

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
        weights on exit; with ``modifier_rank``, that rank's values are broadcast first.
        Without ``modify`` the values are for reading: changes are not kept (stage 3
        drops them on exit, the others at the next step; but float32 parameters at stages
        0-2 are master weights, so do not change them there without ``modify``)."""
        trainable = {id(p) for _, p in self.trainable_parameters()}
        wanted = [p for _, p in self.trainable_parameters()] if params is None else params
        wanted = [p for p in wanted if id(p) in trainable]
        self._gather_for_user(wanted)
        try:
            yield
            if modify:
                if modifier_rank is not None:
                    for p in wanted:
                        self.comm.broadcast(p.data, src=modifier_rank)
                self._write_back({id(p) for p in wanted})
        finally:
            self._release_for_user(wanted)

    def _gather_for_user(self, params: list[nn.Parameter]) -> None:
        return None

    def _release_for_user(self, params: list[nn.Parameter]) -> None:
        return None

    @abc.abstractmethod
    def _write_back(self, wanted: set[int]) -> None:
        """Copy the compute values of the parameters whose ids are in ``wanted`` into
        this rank's part of the master weights."""

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
        masters = self._full_master_values()
        if rank is not None and rank != self.comm.rank:
            return {}
        result: dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in masters:
                result[name] = masters[id(value)].clone()
            elif value.is_floating_point():
                result[name] = value.detach().to(torch.float32, copy=True)
            else:
                result[name] = value.detach().clone()
        return result

    # float32 compute parameters that are the master weights themselves (no second copy);
    # set by every stage when the parameters are float32, so the report does not count the
    # same bytes twice.
    _masters_are_parameters = False

    def _master_bytes(self) -> int:
        return 0 if self._masters_are_parameters else tensor_bytes(self.masters)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds now, by category (views of one storage count once). With
        float32 parameters the master weights are the parameters (stage 0), this rank's
        slice of them (stages 1 and 2) or the compute shard (stage 3), and count once,
        under ``parameters``."""
        return MemoryReport(
            parameters=tensor_bytes(self.module.parameters()),
            gradients=tensor_bytes(self._gradient_tensors()),
            master_weights=self._master_bytes(),
            optimizer_states=optimizer_state_bytes(self.optimizer),
            buffers=tensor_bytes(self.module.buffers()),
            comm_buffers=self.comm.buffers.bytes_held,
        )

    def _first_nonfinite(self, gradients: list[torch.Tensor]) -> str:
        """Collective: the message naming the first parameter, in model order, whose reduced
        gradient is not finite on any rank (the same message on every rank)."""
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        first = len(order)
        for group, g in enumerate(gradients):
            for param, where in self._param_ranges(group):
                if not bool(torch.isfinite(g[where]).all()):
                    first = min(first, order[id(param)])
        token = torch.tensor([first], dtype=torch.int64)
        self.comm.all_reduce(token, ReduceOp.MIN)
        names = [name for name, _ in self.module.named_parameters()]
        name = names[int(token.item())] if token.item() < len(names) else "?"
        return (
            f"[rank {self.comm.rank}] the gradient of parameter {name} is NaN or Inf after "
            f"step {self.global_steps}; no update was applied (ZeroConfig(nonfinite='skip') "
            "skips such steps instead)"
        )

    def _global_row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """Row sums of the whole model's gradient: this data-parallel group's, and, with
        model parallelism, every model-parallel rank's (see model_parallel.py)."""
        mp = self.model_parallel
        if mp is None:
            return self._row_sums(gradients)
        counted = []
        for group, g in enumerate(gradients):
            masked = g.clone()
            for param, where in self._param_ranges(group):
                if not mp.counts_for_norm(param):
                    masked[where] = 0.0
            counted.append(masked)
        rows = self._row_sums(counted)
        everyone = torch.empty(mp.comm.world_size * rows.numel(), dtype=rows.dtype)
        mp.comm.all_gather(everyone, rows)
        return everyone

    def _any_model_parallel_rank(self, flag: bool) -> bool:
        assert self.model_parallel is not None
        token = torch.tensor([int(flag)], dtype=torch.int32)
        self.model_parallel.comm.all_reduce(token, ReduceOp.MAX)
        return bool(token.item())

    def any_rank_int(self, flag: bool) -> bool:
        token = torch.tensor([int(flag)], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(token, ReduceOp.MAX)
        return bool(token.item())


def all_finite(tensor: torch.Tensor, chunk_numel: int) -> bool:
    """Whether every element is finite, checked ``chunk_numel`` elements at a time: the
    check's temporaries (isfinite makes an absolute value and masks of the whole input)
    stay within a bucket instead of growing with the model."""
    flat = tensor.reshape(-1)
    parts = torch.split(flat, chunk_numel)
    return all(bool(torch.isfinite(part).all()) for part in parts)


def restore_grad_view(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the engine's flat-buffer ``view`` again (stages 0 and 1 keep
    gradients as views that autograd fills in place): zeros if backward gave it no
    gradient, a copy if something replaced the view."""
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad.reshape(-1))
    param.grad = view.view(param.shape)


def check_model(module: nn.Module, comm: Communicator, *, values_given: bool = False) -> None:
    """Reject what the engine cannot train, naming the parameter and the fix. With
    ``values_given`` (init_values), parameters may be on the meta device."""
    for name, p in module.named_parameters():
        if p.is_meta and not values_given:
            raise ValueError(
                f"[rank {comm.rank}] parameter {name} is on the meta device: pass its values "
                "with initialize(..., init_values=...) (for example GPT.initial_values(seed))"
            )
        if p.device.type != comm.device.type and not p.is_meta:
            raise ValueError(
                f"[rank {comm.rank}] parameter {name} is on {p.device}, but the {comm.backend} "
                f"communicator works on {comm.device}; move the model with "
                f".to({str(comm.device)!r}) first"
            )
        if p.requires_grad and not p.is_floating_point():
            raise TypeError(f"[rank {comm.rank}] parameter {name} is {p.dtype}: not trainable")
