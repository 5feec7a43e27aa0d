"""Pure choices for mixed hardware: how many micro-batches each rank runs, how large a
shard each rank holds, and the step time that follows. No communication, no clocks: the
profile's figures come in, tuples go out, so every rank computes the same choice from the
same gathered figures.

Virtual ranks (issue 52): physical rank i runs c_i micro-batch slots per micro-step, and
the run is bit for bit the homogeneous run at V = sum(c) ranks whatever the c_i are, so
choosing them changes the speed alone. With t_i seconds per micro-batch on rank i, a
micro-step takes max_i c_i t_i (the ranks wait for the slowest in the gradient fold):

    t = (0.2, 0.4), V = 12:   even (6, 6)  -> max(1.2, 2.4) = 2.4 s
                              chosen (8, 4) -> max(1.6, 1.6) = 1.6 s
                              ideal V / sum(1/t_i) = 12 / 7.5 = 1.6 s

Choosing the c_i is scheduling V identical jobs on machines of speeds 1/t_i to minimise
the makespan; giving each slot in turn to the rank on which it would finish first is
optimal for identical jobs (each greedy step keeps the smallest achievable maximum).
What a step adds once can depend on the counts too (the row reduction: every rank but
rank 0 sends one row per slot), and choose_micro_batches weighs it when given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def _check_positive(name: str, values: Sequence[float], unit: str) -> None:
    if not values:
        raise ValueError(f"{name}: no ranks given; give one value per data-parallel rank")
    for rank, value in enumerate(values):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"{name}: rank {rank}'s {unit} is {value!r}; every rank needs a finite "
                f"value > 0 (measure it again, or give the counts by hand)"
            )


def choose_micro_batches(
    seconds_per_micro_batch: Sequence[float],
    total: int,
    *,
    accumulation: int = 1,
    overhead: Callable[[tuple[int, ...]], float] | None = None,
) -> tuple[int, ...]:
    """Counts c_i >= 1 with sum(c) == ``total`` that minimise the predicted step,
    ``accumulation`` x max_i c_i t_i + ``overhead(c)``, where t_i =
    ``seconds_per_micro_batch[i]`` (one rank's time for one micro-batch's forward and
    backward) and ``overhead`` is what a step adds once (None: nothing, so the makespan
    alone decides). Ties go to the lower rank, so rank 0 holds the largest block among
    equals. Raises ValueError when ``total`` is below the rank count (every rank needs a
    slot) or a time is not a positive number.

    With an ``overhead``, the candidates are the makespan-optimal counts with the ranks
    after rank 0 capped at m slots, for every m: the choice is optimal whenever the overhead
    depends on the counts through m = max(c_1, ..., c_{N-1}) and grows with it, as the row
    reduction's does (rank 0 sends its block pre-added as one row, every other rank its
    slots' rows: hetero.planned.row_padding). A slow rank whose rows cost more than a
    slot then gets fewer slots than its speed alone would give it."""
    times = [float(t) for t in seconds_per_micro_batch]
    _check_positive("seconds_per_micro_batch", times, "seconds per micro-batch")
    if total < len(times):
        raise ValueError(
            f"total {total} micro-batches cannot give each of the {len(times)} ranks one; "
            f"use at least {len(times)} (a multiple of the batch's micro-batch size)"
        )
    best = _capped_greedy(times, total, cap=total)
    if overhead is None or len(times) == 1:
        return best
    best_seconds = predicted_step_seconds(
        best, times, accumulation=accumulation, overhead_seconds=overhead(best)
    )
    for cap in range(max(best[1:]) - 1, 0, -1):
        counts = _capped_greedy(times, total, cap)
        seconds = predicted_step_seconds(
            counts, times, accumulation=accumulation, overhead_seconds=overhead(counts)
        )
        if seconds < best_seconds:
            best, best_seconds = counts, seconds
    return best


def _capped_greedy(times: list[float], total: int, cap: int) -> tuple[int, ...]:
    """The makespan-optimal counts with ranks 1.. holding at most ``cap`` slots (rank 0
    unbounded): each slot in turn goes to the rank, among those with room, on which it
    would end soonest (ties: the lower rank). Optimal for identical jobs on machines of
    speeds 1/t_i with capacities: each greedy step keeps the smallest achievable maximum."""
    counts = [1] * len(times)
    for _ in range(total - len(times)):
        room = [i for i in range(len(times)) if i == 0 or counts[i] < cap]
        best = min(room, key=lambda i: ((counts[i] + 1) * times[i], i))
        counts[best] += 1
    return tuple(counts)


def choose_shard_weights(free_bytes: Sequence[float]) -> tuple[float, ...]:
    """Shard weights proportional to each rank's free memory, summing to 1: rank i holds
    about ``free_bytes[i] / sum(free_bytes)`` of every sharded buffer (the layout rounds the
    boundaries to its alignment). Raises ValueError for a rank without free memory."""
    free = [float(b) for b in free_bytes]
    _check_positive("free_bytes", free, "free memory")
    whole = math.fsum(free)
    return tuple(b / whole for b in free)


def micro_step_seconds(counts: Sequence[int], seconds_per_micro_batch: Sequence[float]) -> float:
    """max_i c_i * t_i: one micro-step, every rank's slots, waiting for the slowest rank."""
    if len(counts) != len(seconds_per_micro_batch):
        raise ValueError(
            f"{len(counts)} counts for {len(seconds_per_micro_batch)} ranks' times; give "
            "one of each per data-parallel rank"
        )
    return max(c * float(t) for c, t in zip(counts, seconds_per_micro_batch, strict=True))


def predicted_step_seconds(
    counts: Sequence[int],
    seconds_per_micro_batch: Sequence[float],
    *,
    accumulation: int = 1,
    overhead_seconds: float = 0.0,
) -> float:
    """A step's time: ``accumulation`` micro-steps of max_i c_i * t_i, then
    ``overhead_seconds`` for what a step adds once (the gradient collectives that do not
    overlap backward, the optimizer step), as measured or modelled by the caller."""
    return accumulation * micro_step_seconds(counts, seconds_per_micro_batch) + overhead_seconds


def ideal_micro_step_seconds(seconds_per_micro_batch: Sequence[float], total: int) -> float:
    """The capacity-weighted lower bound of a micro-step of ``total`` micro-batches,
    total / sum_i (1 / t_i): as if slots could be split between ranks. Integer counts
    reach it when the speeds divide ``total`` exactly (2:1 speeds, 12 slots: 8 and 4)."""
    times = [float(t) for t in seconds_per_micro_batch]
    _check_positive("seconds_per_micro_batch", times, "seconds per micro-batch")
    return total / math.fsum(1.0 / t for t in times)


def even_counts(ranks: int, total: int) -> tuple[int, ...]:
    """The homogeneous split of ``total`` slots over ``ranks`` (the first ranks take one
    more when it does not divide): the baseline the chosen counts are measured against."""
    if ranks < 1 or total < ranks:
        raise ValueError(f"cannot split {total} micro-batches over {ranks} ranks, one each")
    base, extra = divmod(total, ranks)
    return tuple(base + (1 if i < extra else 0) for i in range(ranks))
