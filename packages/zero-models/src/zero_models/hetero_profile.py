"""--micro-batches-per-rank auto and --shard-weights auto: measure each rank, then choose.

    choice = resolve_auto(args, profile_engine, tokens, config, dp, device, padding)

Collective over the data-parallel communicator ``dp``, before the run's engine is built.
Each rank measures on a provisional engine (``profile_engine(counts)``: the run's engine
but for PROFILE_SLOTS slots on every rank and no accumulation), which is then closed:

- t_i, the median seconds of one micro-batch slot (B / V sequences) over PROFILE_STEPS
  micro-steps (after one that warms up), over the slots before the last of each: those
  only stage their gradients (the engine's per-slot work included) and wait for no other
  rank. Each does the run's per-slot work too (the batch read, the memory tracker's
  phases, the loss read) and is padded as the run's slots are
  (--emulate-micro-batch-seconds);
- the whole micro-step and optimizer step (the median over those steps), from which the
  once-per-step cost follows: O = max_i step_i - PROFILE_SLOTS * max_j t_j (the last
  slot's collectives wait for the slowest rank; then the step);
- its free memory once the engine is gone (out_of_memory.available_bytes: CUDA's
  mem_get_info; on CPU the address-space cap RLIMIT_AS less what is mapped, else
  MemAvailable shared among the node's ranks).

The figures are gathered, and every rank computes the same choice with zero_core.hetero:
weights proportional to free memory, counts minimising the predicted step time,
accumulation x max_i c_i t_i + the once-per-step cost, for V slots. The lead prints the
choice and that prediction (with the even split's for comparison). The once-per-step cost
comes from the planner's cost model (zero_core.hetero.planned: the row reduction at the
counts' byte counts, the optimizer step, the after-step gathers) where this machine has
a calibration (zero-plan --calibrate; CPU ranks), scaled so that it gives the measured O
at the profile's own counts (scaled_to_profile: the calibration was taken at a full,
unshared CPU, the ranks may run slower); else it is the measured O.
The bits of the run do not depend on the counts chosen, only on V.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from zero_core.hetero import (
    choose_micro_batches,
    choose_shard_weights,
    even_counts,
    predicted_step_seconds,
)
from zero_core.hetero.planned import planned_overhead
from zero_core.plan.calibrate import load_calibration
from zero_core.plan.cluster import Cluster
from zero_core.plan.presets import this_machine

from .data import BatchSampler
from .gpt import GPTConfig
from .hetero_emulation import SlotPadding
from .hetero_options import AUTO
from .out_of_memory import available_bytes

PROFILE_SLOTS = 4  # per rank and micro-step: 3 timed, and the last, which sends the rows
PROFILE_STEPS = 3  # timed steps, after one that warms up: medians over them


class RankProfile(NamedTuple):
    """One rank's measured figures (module docstring)."""

    seconds_per_micro_batch: float
    profile_step_seconds: float  # PROFILE_SLOTS slots and the optimizer step
    free_bytes: float


class AutoChoice(NamedTuple):
    """What 'auto' chose, from every rank's profile, and the step time it predicts."""

    counts: tuple[int, ...]
    shard_weights: tuple[float, ...] | None
    predicted_step_seconds: float
    even_step_seconds: float
    profiles: tuple[RankProfile, ...]
    # Where the once-per-step cost came from: "measured" (the profile's O) or the
    # planner's cluster (its Cluster.source).
    overhead_source: str = "measured"


def profile_rank(
    engine: zero_core.Engine,
    sampler: BatchSampler,
    device: torch.device,
    padding: SlotPadding,
) -> RankProfile:
    """This rank's RankProfile on ``engine`` (PROFILE_SLOTS slots per rank; collective:
    the last slot of each micro-step reduces with every rank). Each slot does what the
    run's slots do (trainer.forward_backward): it reads its batch from ``sampler``, runs
    forward and backward inside a memory tracker's phases, and reads its loss. Left out,
    that per-slot work went unmeasured, which a rank throttled by a CPU quota pays for
    several times over (docs/mixed-hardware.md)."""
    tracker = zero_core.MemoryTracker(device)
    slot_seconds: list[float] = []
    step_seconds: list[float] = []
    for step in range(1 + PROFILE_STEPS):  # the first warms up
        slots: list[float] = []
        started = time.perf_counter()
        for _ in range(PROFILE_SLOTS):
            slot_start = time.perf_counter()
            with padding:
                inputs, targets = (t.to(device) for t in sampler.batch(step))
                with tracker.phase("forward"):
                    logits = engine(inputs)
                    loss = F.cross_entropy(
                        logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)
                    )
                    del logits
                with tracker.phase("backward"):
                    engine.backward(loss)
                float(loss.item())
                _synchronize(device)
            slots.append(time.perf_counter() - slot_start)
        with tracker.phase("step"):
            engine.step()
        _synchronize(device)
        if step > 0:
            slot_seconds += slots[:-1]
            step_seconds.append(time.perf_counter() - started)
    return RankProfile(statistics.median(slot_seconds), statistics.median(step_seconds), 0.0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The once-per-step cost of a step at the given counts (and shard weights), in seconds.
Overhead = Callable[[Sequence[int], Sequence[float] | None], float]


class PlannedCost(Protocol):
    """The planner's once-per-step cost at the given counts, shard weights and micro-steps
    per step (None: the run's)."""

    def __call__(
        self, counts: Sequence[int], weights: Sequence[float] | None, steps: int | None = None
    ) -> float: ...


def choose(
    profiles: tuple[RankProfile, ...],
    virtual: int,
    accumulation: int,
    want_weights: bool,
    overhead: Overhead | None = None,
    overhead_source: str = "measured",
) -> AutoChoice:
    """The choice every rank makes from the gathered ``profiles`` (pure): the predicted
    step adds ``overhead(counts, weights)`` (the planner's terms), else the measured O;
    the counts minimise that whole step (zero_core.hetero.choose_micro_batches)."""
    times = [p.seconds_per_micro_batch for p in profiles]
    weights = choose_shard_weights([p.free_bytes for p in profiles]) if want_weights else None
    if overhead is None:
        measured = step_overhead(profiles)
        overhead = lambda _counts, _weights: measured  # noqa: E731
        overhead_source = "measured"
    step_cost = overhead
    counts = choose_micro_batches(
        times, virtual, accumulation=accumulation, overhead=lambda c: step_cost(c, weights)
    )
    even = even_counts(len(times), virtual)
    return AutoChoice(
        counts, weights,
        predicted_step_seconds(counts, times, accumulation=accumulation,
                               overhead_seconds=overhead(counts, weights)),
        predicted_step_seconds(even, times, accumulation=accumulation,
                               overhead_seconds=overhead(even, weights)),
        profiles, overhead_source,
    )  # fmt: skip


def planner_overhead(
    zc: zero_core.ZeroConfig, config: GPTConfig, ranks: int, device: torch.device,
    accumulation: int, slot_seconds: float, cluster: Cluster | None = None,
) -> tuple[PlannedCost, str] | None:  # fmt: skip
    """The planner's once-per-step cost for the engine configuration ``zc`` (its stage,
    bucket size, dtypes) of ``config``'s GPT on ``ranks`` ranks, the reduction hiding
    behind at most ``slot_seconds`` of the last slot, and the cluster's source; None where
    the planner has no model of this machine (a CUDA device, or no calibration:
    zero-plan --calibrate). ``cluster`` overrides this machine's calibrated one."""
    if cluster is None:
        calibration = load_calibration() if device.type == "cpu" else None
        if calibration is None:
            return None
        cluster = this_machine(calibration, ranks=ranks, width=config.width)
    reduce_dtype = zc.reduce_dtype or zc.param_dtype
    planned = cluster

    def overhead(
        counts: Sequence[int], weights: Sequence[float] | None, steps: int | None = None
    ) -> float:
        return planned_overhead(
            counts, planned, params=config.num_params, stage=zc.stage,
            bucket_numel=zc.bucket_numel, dtype_bytes=zc.param_dtype.itemsize,
            reduce_bytes=reduce_dtype.itemsize, accumulation=steps or accumulation,
            shard_weights=weights, slot_seconds=slot_seconds,
        ).total  # fmt: skip

    return overhead, f"planner ({cluster.name}: {cluster.source})"


def scaled_to_profile(
    planned: PlannedCost, source: str, profiles: tuple[RankProfile, ...]
) -> tuple[Overhead, str]:
    """The planner's cost scaled by k = O / planned(profile): at the profile's own step
    (PROFILE_SLOTS slots on every rank, even shards, one micro-step) it gives the measured
    O, and the planner's terms say how it changes with the counts and weights. The
    calibration was taken on a full, unshared CPU; ranks that run slower (a CPU quota, a
    slower card, a shared host) run the collectives, the gradient passes and the optimizer
    slower too (measured under a 0.15-CPU quota: k 6-10), which only the profile sees.
    Unscaled where the planner gives no cost at the profile's step."""
    at_profile = planned((PROFILE_SLOTS,) * len(profiles), None, 1)
    if not at_profile > 0:
        return planned, source
    k = step_overhead(profiles) / at_profile
    return (lambda c, w: k * planned(c, w)), f"{source} x {k:.2f} (the profile's measured step)"


def step_overhead(profiles: tuple[RankProfile, ...]) -> float:
    """O = max_i step_i - PROFILE_SLOTS * max_j t_j (>= 0): what a step adds once."""
    slowest = max(p.seconds_per_micro_batch for p in profiles)
    return max(0.0, max(p.profile_step_seconds for p in profiles) - PROFILE_SLOTS * slowest)


def resolve_auto(
    args: argparse.Namespace,
    profile_engine: Callable[[tuple[int, ...]], zero_core.Engine],
    tokens: torch.Tensor,
    config: GPTConfig,
    dp: zero_comm.Communicator,
    device: torch.device,
    padding: SlotPadding,
) -> AutoChoice | None:
    """Collective: the choice for 'auto' in --micro-batches-per-rank or --shard-weights
    (None when neither says auto). Given counts or weights are kept; 'auto' counts are
    chosen for ``args.virtual_total`` slots. The lead prints one line of the choice."""
    counts_auto = args.micro_batches_per_rank == AUTO
    weights_auto = args.shard_weights == AUTO
    if not (counts_auto or weights_auto):
        return None
    sampler = BatchSampler(
        tokens, context=config.context, global_batch=args.batch_size,
        dp_rank=0, dp_size=args.virtual_total, seed=args.seed,
    )  # fmt: skip
    engine = profile_engine((PROFILE_SLOTS,) * dp.world_size)
    try:
        mine = profile_rank(engine, sampler, device, padding)
        engine_config = engine.config
    finally:
        engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    mine = mine._replace(free_bytes=available_bytes(device, 1) or 0.0)
    profiles = tuple(RankProfile(*p) for p in dp.all_gather_object(tuple(mine)))
    # Every rank predicts alike: from the gathered figures, and with the planner only if
    # every rank has this machine's calibration.
    fastest = min(p.seconds_per_micro_batch for p in profiles)
    planner = planner_overhead(
        engine_config, config, dp.world_size, device, args.grad_accum, fastest
    )
    use_planner = dp.all_gather_object(planner is not None)
    overhead: Overhead | None = None
    source = ""
    if planner is not None and all(use_planner):
        overhead, source = scaled_to_profile(*planner, profiles)
    given_weights = None if weights_auto else args.shard_weights
    if overhead is not None and given_weights is not None:
        planned = overhead
        overhead = lambda counts, _weights: planned(counts, given_weights)  # noqa: E731
    choice = choose(profiles, args.virtual_total, args.grad_accum, weights_auto, overhead, source)
    if not counts_auto:
        given = args.micro_batches_per_rank or (1,) * dp.world_size
        times = [p.seconds_per_micro_batch for p in profiles]
        extra = (
            step_overhead(profiles) if overhead is None
            else overhead(given, choice.shard_weights)
        )  # fmt: skip
        predicted = predicted_step_seconds(
            given, times, accumulation=args.grad_accum, overhead_seconds=extra
        )
        choice = choice._replace(counts=tuple(given), predicted_step_seconds=predicted)
    if dp.rank == 0:
        print(describe(choice), flush=True)
    return choice


def describe(choice: AutoChoice) -> str:
    """The lead's line: what was measured, what was chosen, what it predicts."""
    times = ", ".join(f"{p.seconds_per_micro_batch:.3f}" for p in choice.profiles)
    free = ", ".join(f"{p.free_bytes / 2**30:.2f}" for p in choice.profiles)
    counts = ",".join(map(str, choice.counts))
    weights = (
        "" if choice.shard_weights is None
        else " --shard-weights " + ",".join(f"{w:.4f}" for w in choice.shard_weights)
    )  # fmt: skip
    return (
        f"zero-train: auto: seconds per micro-batch [{times}], free GiB [{free}] -> "
        f"--micro-batches-per-rank {counts}{weights}; predicted step "
        f"{choice.predicted_step_seconds:.3f} s (even split: {choice.even_step_seconds:.3f} s; "
        f"slots measured, once per step: {choice.overhead_source})"
    )


def warn_overruns(padding: SlotPadding, rank: int) -> None:
    """A rank whose slots overran their padded duration emulates nothing: say so."""
    if padding.overruns:
        print(
            f"zero-train: note: [rank {rank}] {padding.overruns} micro-batches took longer "
            f"than --emulate-micro-batch-seconds {padding.seconds}; give a longer duration "
            "for a faithful emulation",
            file=sys.stderr, flush=True,
        )  # fmt: skip


def prediction_check(choice: AutoChoice, step_seconds: list[float]) -> str:
    """The lead's last line with 'auto': its predicted step against the measured median
    (the first step, with its start-up, left out when there are others)."""
    measured = statistics.median(step_seconds[1:] or step_seconds) if step_seconds else None
    if measured is None:
        return "zero-train: auto: no step measured to check the prediction against"
    error = 100 * (measured / choice.predicted_step_seconds - 1)
    return (
        f"zero-train: auto: predicted step {choice.predicted_step_seconds:.3f} s, measured "
        f"median {measured:.3f} s ({error:+.1f}%)"
    )
