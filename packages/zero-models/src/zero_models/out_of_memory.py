"""Running out of memory in zero-train: one line per rank, not a traceback from each.

    [rank 1] out of memory in the build at stage 3 (fp32, 2 ranks), allocating 147.2 MiB:
    zero-estimate predicts 0.92 GiB of model states per rank + 80.6 MiB of activations;
    this rank had about 0.29 GiB free; even --offload-optimizer disk --offload-params disk
    --offload-dir DIR would keep 0.32 GiB of model states + 80.6 MiB of activations on the
    device: add ranks, or lower --batch-size, --context or the model's size
                                          (GPT-2 small, one line, wrapped here)

A rank that runs out of memory (torch.OutOfMemoryError, MemoryError, or the allocators'
RuntimeErrors: "DefaultCPUAllocator: can't allocate memory", "CUDA out of memory") in the
build, at the start (a --resume load) or in a step (forward, backward, optimizer step,
the save) prints that line to stderr and ends at once with EXIT_OUT_OF_MEMORY
(``os._exit``: the other ranks are in collectives with it, so a clean shutdown could only
wait for them; zero-launch then stops them without a line of its own). A rank whose
collective fails because a peer ended so (PeerFailureError, or the rendezvous store of a
dead rank 0) says so in one line too, and waits to be stopped, so that the job's exit
code and last word are the peer's.

The prediction is zero-estimate's (zero_core.estimate.model_states.tiered_state_bytes) for this
run's parameters per tensor-parallel rank Ψ, data-parallel ranks N, stage, dtype and tiers,
with AdamW's K, and zero_core.estimate.activations's peak for one micro-step. A tier moves
bytes off the device (the host *is* the device on a CPU-only machine, so there only
"disk" moves any):

    offload_optimizer    the K Ψ / N bytes of masters and optimizer states (stages 1-3)
    offload_params       the p Ψ / N bytes of the parameter shard (stage 3)

What this rank had is measured before the build: the free memory of its GPU, or on the
CPU the address space left under RLIMIT_AS (``ulimit -v``), else the available memory
of the node shared among its ranks. The suggestion is the cheapest change of flags
(stage first, then activation checkpointing, then the optimizer's tier, then the
parameters') whose model states, with the larger of a step's activations and what the
build holds besides (``Footprint.transient``: a parameter's initial value, or with tensor
parallelism the whole model), fit in that; if none does, the one that keeps the least.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch
from torch import distributed as dist

import zero_comm
from zero_comm.peers import is_running
from zero_core.config.zero_config import ZeroConfig
from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_core.estimate.model_states import state_bytes_per_param, tiered_state_bytes
from zero_core.memory.proc_status import process_status_kib

from .train_options import EXIT_FAILED

EXIT_OUT_OF_MEMORY = 71  # sysexits' EX_OSERR: the system could not give the memory asked for
# What a rank meets in a collective when a peer has ended or stopped answering (torch's
# DistError: the rendezvous store, hosted by rank 0, is gone).
PEER_FAILURES = (zero_comm.PeerFailureError, zero_comm.CommTimeoutError, dist.DistError)
PEER_WAIT_S = 10.0  # at most, for the launcher to stop a rank whose peer has ended
GIB, MIB = 2**30, 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# What the allocators say, lower case: torch's CPU allocator, CUDA's, glibc's strerror.
MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory")


def size(nbytes: float) -> str:
    """Bytes as GiB (from a tenth of one) or MiB: "1.91 GiB", "12.5 MiB"."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / MIB:.1f} MiB"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, is running out
    of memory (this rank's: a peer's failure met in a collective is not, whatever it
    says of the peer)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (MemoryError, torch.OutOfMemoryError)):
            return True
        if isinstance(current, PEER_FAILURES):
            return False  # its message may quote a peer's end ("it ran out of memory")
        if isinstance(current, RuntimeError) and any(m in str(current).lower() for m in MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


def failed_allocation(exc: BaseException) -> str:
    """The size the allocator was asked for, as it says it ("147.2 MiB"); "" if it
    does not say."""
    text = str(exc)
    found = re.search(r"allocate (\d+) bytes", text)  # torch's CPU allocator
    if found:
        return size(int(found.group(1)))
    found = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", text)  # CUDA's caching allocator
    return found.group(1) if found else ""


class Placement(NamedTuple):
    """Where a run keeps what: its stage, activation checkpointing and offload tiers."""

    stage: int
    checkpoint: str  # "none", "full" or "partitioned"
    offload_optimizer: str  # "none", "cpu" or "disk"
    offload_params: str


class Footprint(NamedTuple):
    """What zero-estimate needs to know of a run, and what one rank had for it."""

    params: float  # Ψ: parameters of one tensor-parallel rank's model
    ranks: int  # the world
    dp: int  # N: data-parallel ranks
    tp: int
    dtype: str  # "fp32", "bf16" or "fp16"
    placement: Placement
    shape: TransformerShape  # tokens: one micro-step's, on one rank
    device: str  # the device's type: "cpu", "cuda"
    zero: ZeroConfig  # the run's: its tiers' fraction, tiles, buffers; whether offload_dir
    transient: float  # bytes the build holds for a while besides the model states
    available: float | None  # bytes this rank had before the build; None if unknown

    def model_states(self, placement: Placement) -> tuple[float, float]:
        """(model-state bytes per rank in every tier, the bytes in this rank's device
        memory: on a CPU-only machine that is host memory too, the "cpu" tier and the
        disk tier's staging buffers included)."""
        width, zero = DTYPE_BYTES[self.dtype], self.zero
        held = tiered_state_bytes(
            self.params, self.dp, placement.stage,
            optimizer_state_bytes=state_bytes_per_param(width), param_bytes=width,
            grad_bytes=width, offload_optimizer=placement.offload_optimizer,
            offload_params=placement.offload_params, offload_fraction=zero.offload_fraction,
            sub_group_numel=zero.offload_sub_group_numel,
            buffer_count=zero.offload_buffer_count, bucket_numel=zero.bucket_numel,
            largest_param_numel=self.shape.vocab_size * self.shape.width / self.tp,  # embedding
            optimizer_in_backward=zero.optimizer_in_backward,
            offload_gradients=zero.offload_gradients,
        )  # fmt: skip
        device = held.device + (held.host_resident if self.device == "cpu" else 0.0)
        return held.model_states, device

    def activations(self, placement: Placement) -> float:
        """Peak activation bytes of one micro-step (zero_core.estimate.activations)."""
        return activation_bytes(
            self.shape, tp=self.tp, checkpoint=placement.checkpoint,  # type: ignore[arg-type]
            dtype_bytes=DTYPE_BYTES[self.dtype],
        ).peak  # fmt: skip

    def split(self, placement: Placement) -> tuple[float, float]:
        """Bytes of (model states, activations) on the device."""
        return self.model_states(placement)[1], self.activations(placement)

    def on_device(self, placement: Placement) -> float:
        """What ``placement`` needs of this rank's memory, at its peak."""
        states = self.model_states(placement)[1]
        return states + max(self.activations(placement), self.transient)


def available_bytes(device: torch.device, local_ranks: int) -> float | None:
    """What this rank can still take now (see the module docstring); None if unknown."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped_kib = process_status_kib("VmSize")
    if soft != resource.RLIM_INFINITY and mapped_kib is not None:
        return float(soft - mapped_kib * 1024)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / max(1, local_ranks)
    except OSError:
        pass
    return None


def placements(now: Placement, device: str, offload: bool = True) -> list[Placement]:
    """The placements zero-train's flags reach from ``now`` by only lowering the device's
    share, cheapest first: a higher stage, then activation checkpointing, then the
    optimizer's tier, then the parameters' (cpu on a GPU, disk on a CPU-only machine);
    without ``offload`` (the optimizer stepped in backward refuses the tiers) no tier."""
    tier = "cpu" if device == "cuda" else "disk"
    if not offload:
        tier = "none"
    checkpoints = dict.fromkeys(
        [now.checkpoint, "full" if now.checkpoint == "none" else now.checkpoint]
    )
    found = []
    for stage in range(now.stage, 4):
        for checkpoint in checkpoints:
            for optimizer in dict.fromkeys([now.offload_optimizer, tier]):
                for params in dict.fromkeys([now.offload_params, tier]):
                    if (optimizer != "none" and stage == 0) or (params != "none" and stage != 3):
                        continue
                    found.append(Placement(stage, checkpoint, optimizer, params))

    def cost(p: Placement) -> tuple[bool, bool, bool, int]:
        return (p.offload_params != now.offload_params,
                p.offload_optimizer != now.offload_optimizer,
                p.checkpoint != now.checkpoint, p.stage - now.stage)  # fmt: skip

    return sorted((p for p in found if p != now), key=cost)


def flags(now: Placement, to: Placement, offload_dir: str | None) -> str:
    """zero-train's flags that change ``now`` into ``to``."""
    out = []
    if to.stage != now.stage:
        out.append(f"--stage {to.stage}")
    if to.checkpoint != now.checkpoint:
        out.append(f"--checkpoint {to.checkpoint}")
    if to.offload_optimizer != now.offload_optimizer:
        out.append(f"--offload-optimizer {to.offload_optimizer}")
    if to.offload_params != now.offload_params:
        out.append(f"--offload-params {to.offload_params}")
    if "disk" in (to.offload_optimizer, to.offload_params) and offload_dir is None:
        out.append("--offload-dir DIR")
    return " ".join(out)


def advice(run: Footprint) -> str:
    """What would fit: the cheapest change whose prediction fits in what this rank had,
    or, if none does, the one that keeps the least on the device."""
    now = run.placement
    reachable = placements(now, run.device, offload=not run.zero.optimizer_in_backward)
    smaller = [p for p in reachable if run.on_device(p) < run.on_device(now)]
    if not smaller:
        return "no stage or tier keeps less on the device: add ranks, or train a smaller model"

    def keeps(states: float, activations: float) -> str:
        return f"{size(states)} of model states + {size(activations)} of activations on the device"

    if run.available is None:  # nothing to fit in: the change that keeps the least
        best = min(smaller, key=run.on_device)
        return f"{flags(now, best, run.zero.offload_dir)} would keep {keeps(*run.split(best))}"
    fitting = [p for p in smaller if run.on_device(p) <= run.available]
    if fitting:
        best = fitting[0]
        return f"{flags(now, best, run.zero.offload_dir)} would keep {keeps(*run.split(best))}"
    best = min(smaller, key=run.on_device)
    return (f"even {flags(now, best, run.zero.offload_dir)} would keep {keeps(*run.split(best))}"
            ": add ranks, or lower --batch-size, --context or the model's size")  # fmt: skip


def out_of_memory_line(rank: int, phase: str, run: Footprint, exc: BaseException) -> str:
    """The one line a rank prints when it ran out of memory in ``phase`` ("the build",
    "the backward of step 3", ...)."""
    total, device = run.model_states(run.placement)
    ranks = f"{run.ranks} ranks" if run.tp == 1 else f"{run.ranks} ranks, tensor-parallel {run.tp}"
    asked = failed_allocation(exc)
    allocating = f", allocating {asked}" if asked else ""
    tiered = f", {size(device)} of them on the device" if device < total else ""
    had = "" if run.available is None else f"; this rank had about {size(run.available)} free"
    return (
        f"[rank {rank}] out of memory in {phase} at stage {run.placement.stage} ({run.dtype}, "
        f"{ranks}){allocating}: zero-estimate predicts {size(total)} of model states per "
        f"rank{tiered} + {size(run.activations(run.placement))} of activations{had}; "
        f"{advice(run)}"
    )


def remove_swap_folders(offload_dir: str | None) -> None:
    """Remove this process's swap folders under ``offload_dir``, those of an engine whose
    build did not finish (zero_core.offload.build.swap_folder names them by pid; an
    engine built removes its own at close)."""
    if offload_dir is not None:
        for folder in Path(offload_dir).glob(f"zero-swap.rank*.pid{os.getpid()}.*"):
            shutil.rmtree(folder, ignore_errors=True)


def remove_dead_ranks_swap_folders(offload_dir: str | None) -> None:
    """Remove the swap folders under ``offload_dir`` whose rank process is gone (ranks
    ended by a signal could not remove their own); a live process's are left alone."""
    if offload_dir is None:
        return
    for folder in Path(offload_dir).glob("zero-swap.rank*.pid*.*"):
        pid = re.search(r"\.pid(\d+)\.", folder.name)
        if pid is not None and not is_running(int(pid[1])):
            shutil.rmtree(folder, ignore_errors=True)


def say(line: str) -> None:
    """``line`` to stderr in one write, after what this process printed before: the
    ranks share the launcher's stderr, and a line written in pieces can be cut by
    another rank's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def exit_out_of_memory(
    rank: int,
    phase: str,
    run: Footprint,
    exc: BaseException,
    before: Callable[[], None],
    world: zero_comm.Communicator | None = None,
) -> NoReturn:
    """Print the line, tell ``world``'s other ranks that this one leaves ("it ran out of
    memory in PHASE": a rank waiting on it names it so at once, in its own one line),
    call ``before`` (what must not be left behind, as swap files), and end this process
    with EXIT_OUT_OF_MEMORY, skipping the interpreter's shutdown (which would wait for
    the collectives the other ranks are in)."""
    exc.__traceback__ = None  # its frames hold the tensors that did fit: let them go
    try:
        say(out_of_memory_line(rank, phase, run, exc))
        if world is not None:
            world.leave(f"it ran out of memory in {phase}")
        before()
    finally:
        os._exit(EXIT_OUT_OF_MEMORY)


def exit_after_peer_failure(
    rank: int,
    phase: str,
    exc: BaseException,
    before: Callable[[], None],
    signalled: Callable[[], bool],
    world: zero_comm.Communicator | None = None,
) -> NoReturn:
    """A collective failed because a peer ended (out of memory, killed) or stopped
    answering: one line naming the failure, then wait (PEER_WAIT_S at most) for the
    launcher to stop this rank, so that the job ends with the peer's exit code and its
    line, not this one's; then EXIT_FAILED. A signal (``signalled``: already received)
    ends the wait at once. ``world``'s other ranks hear that this one leaves, with the
    failure it met (a third rank waiting on it names the first cause, not this rank)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[rank \d+\] ", "", text)
    line = f"[rank {rank}] stopped in {phase}: {type(exc).__name__}: {text}"
    exc.__traceback__ = None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: os._exit(128 + number))
    try:
        say(line)
        if world is not None:
            world.leave()
        before()
        deadline = time.monotonic() + PEER_WAIT_S
        while not signalled() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os._exit(EXIT_FAILED)


@contextmanager
def stop_in_one_line(
    rank: int,
    phase: Callable[[], str],
    run: Footprint,
    *,
    before: Callable[[], None] = lambda: None,
    signalled: Callable[[], bool] = lambda: False,
    world: zero_comm.Communicator | None = None,
) -> Iterator[None]:
    """A block in which running out of memory, or a collective failing for a peer's end,
    ends this rank with one line (``phase()`` names where; ``before`` runs first; see
    exit_out_of_memory and exit_after_peer_failure), and ``world``'s other ranks, each
    in one line of its own, name this rank and why it left. Any other error passes
    through."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if is_out_of_memory(exc):
            exit_out_of_memory(rank, phase(), run, exc, before, world)
        if isinstance(exc, PEER_FAILURES):
            exit_after_peer_failure(rank, phase(), exc, before, signalled, world)
        raise
