"""ZeRO-Offload's one-step delayed parameter update (DPU): the host's optimizer update of
step t runs in a background thread while the device runs forward and backward of step t+1.

Opt in with ``ZeroConfig(delayed_parameter_update=True)`` (needs ``offload_optimizer``
"cpu" or "disk"; zero-train: ``--delayed-parameter-update``). DeepSpeed never shipped it;
the paper (Ren et al., "ZeRO-Offload", 2021, section 4.2) describes it.

The step, with M_t the master weights (and optimizer states) after step t's update, g_t
the gradients reduced at step t, and P_t the parameters forward and backward of step t
compute with:

    synchronous      step t: M_t = update(M_{t-1}, g_t); publish M_t      P_{t+1} = M_t
    delayed          step t: boundary gradients g_t (divided, overflow check, clipping:
                             on the calling thread, collectives included)
                             take ownership of g_t (below)
                             wait for the update launched at step t-1, publish M_{t-1}
                             launch M_t = update(M_{t-1}, g_t) in a background thread
                             return True
                                                                          P_{t+1} = M_{t-1}

    step:            1       2       3       4   ...
    forward sees     M_0     M_0     M_1     M_2      (M_0: the initial weights)
    update launched  g_1     g_2     g_3     g_4      (each g_t computed at P_t)
    published        -       M_1     M_2     M_3

So the forward of step t+1 sees every update up to g_{t-1}, and the gradient of step t is
taken at weights two updates old: the staleness the paper analyses (one step). A skipped
step (float16 overflow, ``nonfinite="skip"``) launches nothing and still publishes the
pending update, so P_{t+1} = M_{t-1} = M_t holds through skips too.

Loss scaling (float16): the skip decision and the scale's update are made on the calling
thread from step t's gradients, at the launching step, exactly as without DPU (the
gradients are already unscaled when the update is launched); nothing of the scaler runs
in the background, so dynamic scaling stays exact. Clipping: the global norm is computed
on the calling thread before the launch (``engine.last_grad_norm`` is step t's). The
learning-rate schedule: the update runs on a snapshot of the optimizer's options taken at
launch (``options_snapshot``), so a scheduler stepped after ``engine.step()`` (the
engine's own, or the user's over ``engine.optimizer``) sets the next update's options, as
without DPU, and never races the running one.

Flush points. ``engine.save()`` (and ``load``, ``gathered_parameters``) waits for the
update in flight and publishes it: a checkpoint holds the masters, optimizer states and
counters after every step taken (M_t, ``global_steps`` = t), and the next forward sees
M_t (the flush resets the delay: P_{t+1} = M_t). A run that saves at step k and resumes
therefore equals the uninterrupted run with a save at step k, bit for bit; a load
publishes what it loads. Reads that change nothing (``full_state_dict``,
``sharded_state``, ``memory_report``) only wait for the update (they read M_t) and leave
the publish to the next step, so calling them does not change the run. ``close()`` waits.
Gradient-norm reporting needs nothing from the update (the norm is the launching step's).
Touching ``engine.optimizer``'s state between steps (not its options) needs
``engine.flush_update()`` first.

Ownership of the inputs. The gradient shard the update reads is freed by ``zero_grad``
(ShardGradient.release resizes its storage to 0) and refilled by the next backward, so
the update gets its own copy (``own_gradients``): float32 gradients that are views of
the gradient buffers (float32 compute, or ``reduce_dtype=float32``) are copied (the step
already copied 16-bit ones into float32 tensors of their own, which are kept, not copied
again); offloaded slices (``offload_gradients``: in host memory or swap files, refilled
by the next backward too) are read back as float32 host copies, scaled as the step
scaled them (``ShardGradient.clone``), so the update never reads the next step's values
(a read of a released slice raises). On a CUDA device the copy goes to host memory
(pinned), made on the calling thread and waited for by the update through an event.
Memory: one float32 gradient shard, 4Ψ/N bytes, held from the launch until the update
finishes, in host memory on a GPU (in the device memory, which is the host, on a
CPU-only machine), on top of what the next backward holds; the updated values of disk
tiles wait for the publish in the compute dtype (Ψ_disk/N elements), those of resident
tiles are the tiles themselves.

Thread safety: the background update and the next forward/backward touch disjoint
tensors. The update touches the master tiles (separate tensors: offloaded masters are
never aliased to the compute parameters, OffloadedMasters.aliased is False), their swap
pipeline (its own buffers, files and I/O threads; the parameters' disk tier has others),
``optimizer.state`` (entries of master tiles only), a snapshot of ``param_groups``, its
own gradient copies, and the list of updated values it stages. The calling thread, until
it waits, touches the compute parameters (replicated buckets or stage 3 shards and their
tier), the gradient buffers, the communicator and the activations, and not the masters,
the optimizer's state or the staged list: every path that reads them waits first
(``settle``), and the join is the happens-before edge from the update's writes to those
reads. The update runs no collective, so the ranks' collectives stay in one order on one
thread, and a dead peer is named by the next collective of forward or backward as
without DPU (zero_comm's failure reporting).

Failures: an exception inside the update is kept and raised again on the calling thread
at the next step or flush, the same exception object with its original traceback (and a
note naming the step); the engine's masters are then partly updated, so every later step
or flush refuses to go on (load a checkpoint into a new engine). ``close()`` does not
raise it.

On a CPU-only machine the host is the device: the update overlaps forward and backward
only as far as the cores allow (both use torch's intra-op threads), see docs/offload.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero_comm.profiler_ranges import profiler_range

from .master_weights import TileVisitor
from .offload.tiers import host_empty
from .reduced_gradient import GroupGradient, ShardGradient, has_storage, pieces_of

Staged = tuple[int, int, torch.Tensor]  # (group, start in the master, updated values)


class DelayedUpdateError(RuntimeError):
    """An earlier delayed update failed: the engine's state is partly updated."""


def options_snapshot(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A view of ``optimizer`` for one background step: the same object in everything
    (its ``state`` dict, hooks, defaults) but ``param_groups``, whose dicts are copies
    taken now (tensor options cloned: a scheduler fills a tensor ``lr`` in place), holding
    the same parameter lists. The background update steps it, so options changed on the
    calling thread meanwhile apply to the next update, never half of this one.

    An instance attribute ``step`` is left out: torch's LR schedulers wrap the step of the
    optimizer they drive in one (to warn of a scheduler stepped first), bound to that
    optimizer and so to its live options; its one effect is set here instead."""
    shadow = object.__new__(type(optimizer))
    attributes = dict(optimizer.__dict__)
    if attributes.pop("step", None) is not None:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the wrapper sets
    shadow.__dict__.update(attributes)
    shadow.param_groups = [
        {
            key: value.clone() if isinstance(value, torch.Tensor) and key != "params" else value
            for key, value in group.items()
        }
        for group in optimizer.param_groups
    ]
    return shadow


def own_gradients(
    gradients: Sequence[GroupGradient],
    held: Sequence[torch.Tensor],
    device: torch.device,
    pin: bool,
) -> tuple[list[GroupGradient], Any]:
    """``gradients`` (float32, per group), each made the update's own: on a CUDA device
    copied into host memory (pinned with ``pin``) on the current stream, else copied when
    it shares storage with ``held`` (the gradient component's buffers, freed and reused by
    the next backward) and kept when it is a tensor of its own. Returns the gradients and
    the CUDA event the copies complete at (None on the CPU)."""
    # Offloaded slices are refilled by the next backward: read back, owned, as copies.
    gradients = [g.clone() if isinstance(g, ShardGradient) and g.away else g for g in gradients]
    if device.type == "cuda":

        def to_host(piece: torch.Tensor) -> torch.Tensor:
            copy = host_empty(piece.numel(), piece.dtype, device, pin)
            return copy.copy_(piece.reshape(-1), non_blocking=True).view(piece.shape)

        owned = [_rebuilt(g, [to_host(p) for p in pieces_of(g)]) for g in gradients]
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return owned, event
    storages = {t.untyped_storage().data_ptr() for t in held if t.numel() and has_storage(t)}

    def own(piece: torch.Tensor) -> torch.Tensor:
        shared = piece.numel() and piece.untyped_storage().data_ptr() in storages
        return piece.clone() if shared else piece

    return [_rebuilt(g, [own(p) for p in pieces_of(g)]) for g in gradients], None


def _rebuilt(gradient: GroupGradient, pieces: list[torch.Tensor]) -> GroupGradient:
    if isinstance(gradient, ShardGradient):
        return ShardGradient(pieces, gradient.offsets)
    return pieces[0]


class DelayedUpdate:
    """The update in flight (at most one) and the updated values awaiting their publish;
    see the module docstring. Called from the engine's thread only."""

    def __init__(self, masters: Any, dtype: torch.dtype, device: torch.device, rank: int,
                 pin: bool) -> None:  # fmt: skip
        """``masters``: offloaded master weights (``step(optimizer, gradients, updated)``,
        ``tiles``: per group, (tile, where) pairs, resident tiles with elements);
        ``dtype``: the compute dtype (disk tiles' values are staged in it)."""
        if getattr(masters, "aliased", True):
            raise ValueError(
                "the delayed parameter update needs master weights of their own, not the "
                "parameters' storage (offload_optimizer='cpu' or 'disk')"
            )
        self.masters = masters
        self.dtype = dtype
        self.device = device
        self.rank = rank
        self.pin = pin
        self._thread: threading.Thread | None = None
        self._launched_at = 0  # the step (engine.global_steps + 1) of the update in flight
        self._error: BaseException | None = None
        self._failed = ""  # set once a failure was raised: later calls refuse
        self._staged: list[Staged] = []  # the finished update's values, not yet published
        # Resident tiles keep their storage from one step to the next: their updated
        # values are handed over as they are; a disk tile's live in a pipeline buffer.
        self._resident = {
            tile.data_ptr() for tiles in masters.tiles for tile, _ in tiles if tile.numel()
        }

    @property
    def in_flight(self) -> bool:
        """Whether an update was launched and not waited for."""
        return self._thread is not None

    @property
    def pending(self) -> bool:
        """Whether an update was launched and its values are not published yet."""
        return self._thread is not None or bool(self._staged)

    # ------------------------------------------------------------------ launch
    def launch(
        self,
        optimizer: torch.optim.Optimizer,
        gradients: Sequence[GroupGradient],
        held: Sequence[torch.Tensor],
        step: int,
    ) -> None:
        """Start ``optimizer``'s update of the masters with ``gradients`` (this boundary's,
        final: divided and clipped) in the background; ``held``: the gradient buffers the
        next backward reuses; ``step``: its number, for messages. The previous update
        must have been published (``publish``)."""
        self._refuse_after_failure()
        if self.pending:
            raise RuntimeError(
                f"[rank {self.rank}] a delayed update was launched before the previous "
                "one was published (publish first)"
            )
        owned, event = own_gradients(gradients, held, self.device, self.pin)
        shadow = options_snapshot(optimizer)
        staged = self._staged
        device = self.device

        def keep(group: int, start: int, values: torch.Tensor) -> None:
            if values.data_ptr() not in self._resident:
                values = values.to(self.dtype, copy=True)  # a pipeline buffer, reused
            staged.append((group, start, values))

        def run() -> None:
            try:
                if event is not None:
                    event.synchronize()  # the gradients' copies into host memory
                if device.type == "cuda":
                    with torch.cuda.device(device):  # the thread's current device
                        self.masters.step(shadow, owned, keep)
                else:
                    self.masters.step(shadow, owned, keep)
            except BaseException as exc:  # raised again on the engine's thread (settle)
                self._error = exc

        self._launched_at = step
        self._thread = threading.Thread(
            target=run, name=f"zero-delayed-update-rank{self.rank}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ wait, publish
    def settle(self) -> None:
        """Wait for the update in flight, if any; raise what it raised (once; after that
        every call refuses). Its values stay staged for ``publish``."""
        self._refuse_after_failure()
        if self._thread is None:
            return
        with profiler_range("delayed_update_wait"):
            self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            self._staged = []
            self._failed = (
                f"[rank {self.rank}] the delayed parameter update of step "
                f"{self._launched_at} failed ({type(error).__name__}: {error}); the master "
                "weights and optimizer states are partly updated, so this engine cannot go "
                "on: load the last checkpoint into a new engine"
            )
            if hasattr(error, "add_note"):
                error.add_note(
                    f"[rank {self.rank}] raised in the background thread of the delayed "
                    f"parameter update of step {self._launched_at} "
                    "(ZeroConfig.delayed_parameter_update)"
                )
            raise error

    def publish(self, take: TileVisitor, finish: Callable[[], None]) -> bool:
        """Wait for the update in flight, then hand its updated values to ``take`` (the
        parameters' ``take_master_values``, in the order the update produced them) and
        call ``finish`` (their ``publish``). False, and nothing called, when there was
        nothing to publish."""
        self.settle()
        staged, self._staged = self._staged, []
        if not staged:
            return False
        with profiler_range("publish"):
            for group, start, values in staged:
                take(group, start, values)
            finish()
        return True

    def discard(self) -> None:
        """Wait for the update in flight and drop its values unpublished (a load replaces
        the masters and publishes them itself)."""
        self.settle()
        self._staged = []

    def close(self) -> None:
        """Wait for the update in flight without raising (the engine is closing)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._staged = []

    def _refuse_after_failure(self) -> None:
        if self._failed:
            raise DelayedUpdateError(self._failed)
