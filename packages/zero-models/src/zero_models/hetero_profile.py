"""--micro-batches-per-rank auto and --shard-weights auto: measure each rank, then choose.

    counts, weights = resolve_auto(args, config, tokens, dp, device, padding)

Collective over the data-parallel communicator ``dp``, before the engine is built. Each
rank measures, on a plain copy of the GPT (no engine, no collectives in it):

- t_i, the median seconds of PROFILE_MICRO_BATCHES forward+backward passes of one
  micro-batch slot (B / V sequences), after one warm-up pass, padded as the run's slots
  are (--emulate-micro-batch-seconds);
- the step's once-per-step cost: an all-reduce of Ψ float32 elements over ``dp`` (stage
  0-2's 2Ψ ring traffic; x1.5 at stage 3's 3Ψ) and an AdamW step over the rank's share of
  Ψ (all of it at stage 0, Ψ/N above);
- its free memory after the copy is gone (out_of_memory.available_bytes: CUDA's
  mem_get_info; on CPU the address-space cap RLIMIT_AS less what is mapped, else
  MemAvailable shared among the node's ranks).

The figures are gathered, and every rank computes the same choice with zero_core.hetero:
counts minimising accumulation * max_i c_i t_i for V slots, weights proportional to free
memory. The lead prints the choice and the predicted step time (with the even split's for
comparison). The bits of the run do not depend on the counts chosen, only on V.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import NamedTuple

import torch
from torch.nn import functional as F

import zero_comm
from zero_core.hetero import (
    choose_micro_batches,
    choose_shard_weights,
    even_counts,
    predicted_step_seconds,
)

from .data import BatchSampler
from .gpt import GPT, GPTConfig
from .hetero_emulation import SlotPadding
from .hetero_options import AUTO
from .out_of_memory import available_bytes

PROFILE_MICRO_BATCHES = 3
STAGE3_TRAFFIC = 1.5  # 3Ψ against the other stages' 2Ψ


class RankProfile(NamedTuple):
    """One rank's measured figures (module docstring)."""

    seconds_per_micro_batch: float
    step_overhead_seconds: float
    free_bytes: float


class AutoChoice(NamedTuple):
    """What 'auto' chose, from every rank's profile, and the step time it predicts."""

    counts: tuple[int, ...]
    shard_weights: tuple[float, ...] | None
    predicted_step_seconds: float
    even_step_seconds: float
    profiles: tuple[RankProfile, ...]


def profile_rank(
    args: argparse.Namespace,
    config: GPTConfig,
    tokens: torch.Tensor,
    dp: zero_comm.Communicator,
    device: torch.device,
    padding: SlotPadding,
) -> RankProfile:
    """This rank's RankProfile (collective: the all-reduce is timed on every rank)."""
    virtual: int = args.virtual_total
    model = GPT(config, seed=args.seed).to(device)
    sampler = BatchSampler(
        tokens, context=config.context, global_batch=args.batch_size,
        dp_rank=0, dp_size=virtual, seed=args.seed,
    )  # fmt: skip
    inputs, targets = (t.to(device) for t in sampler.batch(0))
    times = []
    for _ in range(1 + PROFILE_MICRO_BATCHES):  # the first warms up
        start = time.perf_counter()
        with padding:
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            _synchronize(device)
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()  # the first step makes the states; the second is the steady cost
    start = time.perf_counter()
    optimizer.step()
    _synchronize(device)
    # Stages 1-3 step a 1/N shard of the model (stage 0 all of it).
    step_seconds = (time.perf_counter() - start) / (1 if args.stage == 0 else dp.world_size)
    del model, optimizer, logits, loss
    flat = torch.zeros(params, dtype=torch.float32, device=device)
    dp.barrier()
    start = time.perf_counter()
    dp.all_reduce(flat)
    _synchronize(device)
    traffic = (time.perf_counter() - start) * (STAGE3_TRAFFIC if args.stage == 3 else 1.0)
    del flat
    return RankProfile(statistics.median(times[1:]), step_seconds + traffic,
                       available_bytes(device, 1) or 0.0)  # fmt: skip


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def choose(
    profiles: tuple[RankProfile, ...], virtual: int, accumulation: int, want_weights: bool
) -> AutoChoice:
    """The choice every rank makes from the gathered ``profiles`` (pure)."""
    times = [p.seconds_per_micro_batch for p in profiles]
    counts = choose_micro_batches(times, virtual)
    overhead = max(p.step_overhead_seconds for p in profiles)
    weights = choose_shard_weights([p.free_bytes for p in profiles]) if want_weights else None
    return AutoChoice(
        counts, weights,
        predicted_step_seconds(counts, times, accumulation=accumulation, overhead_seconds=overhead),
        predicted_step_seconds(even_counts(len(times), virtual), times, accumulation=accumulation,
                               overhead_seconds=overhead),
        profiles,
    )  # fmt: skip


def resolve_auto(
    args: argparse.Namespace,
    config: GPTConfig,
    tokens: torch.Tensor,
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
    mine = profile_rank(args, config, tokens, dp, device, padding)
    profiles = tuple(RankProfile(*p) for p in dp.all_gather_object(tuple(mine)))
    choice = choose(profiles, args.virtual_total, args.grad_accum, weights_auto)
    if not counts_auto:
        given = args.micro_batches_per_rank or (1,) * dp.world_size
        times = [p.seconds_per_micro_batch for p in profiles]
        overhead = max(p.step_overhead_seconds for p in profiles)
        predicted = predicted_step_seconds(
            given, times, accumulation=args.grad_accum, overhead_seconds=overhead
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
        f"{choice.predicted_step_seconds:.3f} s (even split: {choice.even_step_seconds:.3f} s)"
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
