"""Activation checkpointing with ZeRO-R's P_a, P_a+cpu and M_D (Rajbhandari et al. 2019,
sections 6.1 and 6.3).

A checkpointed function ``f`` keeps only its input ``x`` for backward and runs ``f(x)``
again there. Under tensor parallelism ``x`` (a transformer block's input) is replicated
on the p ranks of the model-parallel group, so P_a keeps 1/p of it per rank and
all-gathers it just before the recomputation:

    x (B, T, C) flattened and padded to p * k elements
    [ rank 0: 0..k | rank 1: k..2k | ... | rank p-1 ]     rank r keeps elements [r k, (r+1) k)

    forward:   y = f(x) without saving anything inside f; keep my k elements
    backward:  all-gather the p pieces -> x; y = f(x) with grad; backward through it -> dx

    kept per checkpoint per rank:  ordinary  B T C       P_a  ceil(B T C / p)   elements
    extra communication:           one all-gather of B T C (p-1)/p elements per checkpoint

P_a+cpu (``offload=True``) keeps the pieces in host memory (pinned when the model runs on
CUDA) and copies them back for the gather; on a CPU-only machine they already live there.
M_D (``contiguous=True``) copies each piece into a slot of one pre-allocated
:class:`CheckpointArena` as it is produced.

Gradients equal ordinary checkpointing's bit for bit: the gathered ``x`` is ``x``, and the
recomputation is the same function of the same input under the same RNG state.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from zero_comm import Communicator

from .activation_arena import CheckpointArena


class _Kept:
    """One checkpoint's kept piece. ``on_drop`` (uncount its bytes, free its arena slot) runs
    once: when backward restores it, or when its graph is dropped without a backward."""

    def __init__(self, piece: torch.Tensor, slot: int | None, on_drop: Callable[[], None]) -> None:
        self.piece: torch.Tensor | None = piece
        self.slot = slot
        self._finalizer = weakref.finalize(self, on_drop)

    def release(self) -> None:
        self.piece = None
        self._finalizer()


class ActivationCheckpointing:
    """Checkpoint functions of one tensor: ``y = checkpointing(f, x)``.

    ``comm`` is the model-parallel (tensor-parallel) group whose ranks hold the same ``x``;
    with ``partition=True`` and more than one rank there, each keeps only its 1/p piece.
    ``slots`` is how many checkpoints live at once (the number of checkpointed layers); it
    sizes the arena when ``contiguous=True``. ``bytes_kept`` / ``peak_bytes_kept`` count the
    checkpoint bytes this rank holds; ``gathered_elements`` the all-gather volume of P_a in
    the ring convention of ``zero_comm`` stats (output elements x (p-1)/p).
    """

    def __init__(
        self,
        comm: Communicator | None = None,
        *,
        partition: bool = True,
        offload: bool = False,
        contiguous: bool = True,
        slots: int = 1,
    ) -> None:
        self.comm = comm
        self.partition = partition and comm is not None and comm.world_size > 1
        self.offload = offload
        self.contiguous = contiguous
        self.slots = slots
        self._arena: CheckpointArena | None = None
        self.bytes_kept = 0
        self.peak_bytes_kept = 0
        self.gathered_elements = 0.0
        self.checkpoints = 0

    @property
    def arena(self) -> CheckpointArena | None:
        return self._arena

    def __call__(
        self, function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return function(x)  # nothing will run backward: nothing to keep
        if not x.requires_grad:
            raise ValueError(
                "activation checkpointing: the checkpointed input does not require grad, so "
                "the parameters inside the checkpointed function would get no gradients; "
                "checkpoint a later layer, or call x.requires_grad_() on its input"
            )
        out: torch.Tensor = _Checkpointed.apply(function, self, x)  # type: ignore[no-untyped-call]
        return out

    # ------------------------------------------------------------------ pieces
    def _piece_range(self, numel: int) -> tuple[int, int, int]:
        """(start, stop, k): this rank keeps flat elements [start, stop) of k per rank."""
        if not self.partition:
            return 0, numel, numel
        assert self.comm is not None
        k = math.ceil(numel / self.comm.world_size)
        start = min(self.comm.rank * k, numel)
        return start, min(start + k, numel), k

    def _storage_device(self, x: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else x.device

    def keep(self, x: torch.Tensor) -> _Kept:
        """This rank's piece of ``x``, copied where it is kept."""
        flat = x.detach().reshape(-1)
        start, stop, k = self._piece_range(flat.numel())
        arena: CheckpointArena | None = None
        slot: int | None = None
        if not (self.partition or self.contiguous or self.offload):
            piece = flat  # ordinary checkpointing: keep x itself
        else:
            device = self._storage_device(x)
            if self.contiguous:
                arena = self._arena_for(device, x)
                piece, slot = arena.take(k, x.dtype)
            else:
                piece = torch.empty(k, dtype=x.dtype, device=device, pin_memory=_pin(device, x))
            piece[: stop - start].copy_(flat[start:stop], non_blocking=True)
            piece[stop - start :].zero_()
        nbytes = piece.numel() * piece.element_size()
        self.bytes_kept += nbytes
        self.peak_bytes_kept = max(self.peak_bytes_kept, self.bytes_kept)
        self.checkpoints += 1
        return _Kept(piece, slot, functools.partial(self._dropped, nbytes, arena, slot))

    def _dropped(self, nbytes: int, arena: CheckpointArena | None, slot: int | None) -> None:
        self.bytes_kept -= nbytes
        if arena is not None:
            arena.give_back(slot)

    def restore(self, kept: _Kept, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The whole ``x`` again (gathered across the group with P_a); frees the piece."""
        assert kept.piece is not None, "a checkpoint is restored once"
        piece = kept.piece.to(device, non_blocking=True)
        numel = math.prod(shape)
        if self.partition:
            assert self.comm is not None
            whole = torch.empty(
                piece.numel() * self.comm.world_size, dtype=piece.dtype, device=device
            )
            self.comm.all_gather(whole, piece, label="activation checkpoint")
            p = self.comm.world_size
            self.gathered_elements += whole.numel() * (p - 1) / p
            x = whole[:numel].view(shape)
        else:
            x = piece[:numel].view(shape)
            if kept.slot is not None and piece is kept.piece:
                x = x.clone()  # the slot is handed out again: the recomputation needs its own
        kept.release()
        return x

    def _arena_for(self, device: torch.device, x: torch.Tensor) -> CheckpointArena:
        if self._arena is None or self._arena.device != device:
            self._arena = CheckpointArena(self.slots, device=device, pin_memory=_pin(device, x))
        return self._arena


def _pin(device: torch.device, x: torch.Tensor) -> bool:
    """Pinned host memory makes copies from a GPU asynchronous; it needs CUDA."""
    return device.type == "cpu" and x.device.type == "cuda"


class _Checkpointed(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        function: Callable[[torch.Tensor], torch.Tensor],
        checkpointing: ActivationCheckpointing,
        x: torch.Tensor,
    ) -> torch.Tensor:
        ctx.function, ctx.checkpointing = function, checkpointing
        ctx.shape, ctx.device = x.shape, x.device
        ctx.rng = _rng_state(x.device)
        ctx.kept = checkpointing.keep(x)
        return function(x)  # autograd runs forward without recording a graph

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor | None]:
        x = ctx.checkpointing.restore(ctx.kept, ctx.shape, ctx.device).requires_grad_(True)
        with torch.random.fork_rng(devices=_cuda_devices(ctx.device)):
            _set_rng_state(ctx.device, ctx.rng)
            with torch.enable_grad():
                y = ctx.function(x)
        torch.autograd.backward(y, grad)
        return None, None, x.grad


def _cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
