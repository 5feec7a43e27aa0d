"""zero_core.hetero's pure choices: the counts minimise the predicted micro-step (checked
against every split by brute force), faster ranks never get fewer slots, shard weights are
proportional to free memory, and wrong figures are refused naming the rank."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.hetero import (
    choose_micro_batches,
    choose_shard_weights,
    even_counts,
    ideal_micro_step_seconds,
    micro_step_seconds,
    predicted_step_seconds,
)

times = st.lists(st.floats(0.01, 10.0, allow_nan=False), min_size=1, max_size=4)


def splits(ranks: int, total: int) -> list[tuple[int, ...]]:
    """Every way of giving ``total`` slots to ``ranks`` ranks, at least one each."""
    return [
        c for c in itertools.product(range(1, total - ranks + 2), repeat=ranks) if sum(c) == total
    ]


@settings(max_examples=150, deadline=None)
@given(times, st.integers(0, 7))
def test_counts_are_optimal(seconds: list[float], extra: int) -> None:
    total = len(seconds) + extra
    counts = choose_micro_batches(seconds, total)
    assert sum(counts) == total and min(counts) >= 1 and len(counts) == len(seconds)
    best = min(micro_step_seconds(c, seconds) for c in splits(len(seconds), total))
    assert micro_step_seconds(counts, seconds) == best
    assert best >= ideal_micro_step_seconds(seconds, total) * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(times, st.integers(0, 30))
def test_a_faster_rank_never_gets_fewer_slots(seconds: list[float], extra: int) -> None:
    counts = choose_micro_batches(seconds, len(seconds) + extra)
    for i, j in itertools.permutations(range(len(seconds)), 2):
        if seconds[i] < seconds[j]:
            assert counts[i] >= counts[j], (seconds, counts)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 30), st.floats(0.01, 5.0))
def test_equal_speeds_give_the_even_split(ranks: int, extra: int, t: float) -> None:
    total = ranks + extra
    assert choose_micro_batches([t] * ranks, total) == even_counts(ranks, total)


@settings(max_examples=100, deadline=None)
@given(times, st.integers(0, 20), st.floats(0.1, 100.0))
def test_scaling_every_time_keeps_the_choice(seconds: list[float], extra: int, k: float) -> None:
    total = len(seconds) + extra
    scaled = [t * k for t in seconds]
    a, b = choose_micro_batches(seconds, total), choose_micro_batches(scaled, total)
    # Rounding may break a tie differently; the micro-step it predicts may not differ.
    assert math.isclose(micro_step_seconds(a, scaled), micro_step_seconds(b, scaled), rel_tol=1e-9)


def test_the_issues_mix() -> None:
    assert choose_micro_batches([0.2, 0.4], 12) == (8, 4)
    assert even_counts(2, 12) == (6, 6)
    assert ideal_micro_step_seconds([0.2, 0.4], 12) == pytest.approx(1.6)
    assert micro_step_seconds((6, 6), [0.2, 0.4]) == pytest.approx(2.4)
    assert predicted_step_seconds((8, 4), [0.2, 0.4], accumulation=2, overhead_seconds=0.1) == (
        pytest.approx(3.3)
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(1.0, 1e12, allow_nan=False), min_size=1, max_size=8))
def test_shard_weights_follow_free_memory(free: list[float]) -> None:
    weights = choose_shard_weights(free)
    assert math.isclose(math.fsum(weights), 1.0, rel_tol=1e-12)
    assert all(w > 0 for w in weights)
    for i, j in itertools.combinations(range(len(free)), 2):
        assert math.isclose(weights[i] * free[j], weights[j] * free[i], rel_tol=1e-9)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_rank_without_a_figure_is_named(bad: float) -> None:
    with pytest.raises(ValueError, match="rank 1"):
        choose_micro_batches([0.1, bad], 4)
    with pytest.raises(ValueError, match="rank 1"):
        choose_shard_weights([1.0, bad])


def test_too_few_slots_name_the_fix() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        choose_micro_batches([0.1, 0.2, 0.3], 2)
    with pytest.raises(ValueError, match="one of each"):
        micro_step_seconds((1, 2), [0.1])


def rows_sent(counts: tuple[int, ...]) -> int:
    """The row reduction's padding (hetero.planned.row_padding): rank 0 sends one row."""
    return max(1, *counts[1:]) if len(counts) > 1 else 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.01, 10.0, allow_nan=False), min_size=2, max_size=3),
    st.integers(0, 7),
    st.integers(1, 3),
    st.floats(0.0, 5.0),
    st.floats(0.0, 1.0),
)
def test_counts_with_a_row_cost_are_optimal(
    seconds: list[float], extra: int, accumulation: int, per_row: float, fixed: float
) -> None:
    """With a once-per-step cost growing with the rows the other ranks send, the choice
    minimises the whole predicted step over every split (brute force)."""
    total = len(seconds) + extra

    def overhead(c: tuple[int, ...]) -> float:
        return fixed + per_row * rows_sent(c)

    def step(c: tuple[int, ...]) -> float:
        return predicted_step_seconds(
            c, seconds, accumulation=accumulation, overhead_seconds=overhead(c)
        )

    counts = choose_micro_batches(seconds, total, accumulation=accumulation, overhead=overhead)
    assert sum(counts) == total and min(counts) >= 1 and len(counts) == len(seconds)
    best = min(step(c) for c in splits(len(seconds), total))
    assert step(counts) <= best * (1 + 1e-12)
    # A constant cost changes nothing: the makespan alone decides.
    assert choose_micro_batches(
        seconds, total, accumulation=accumulation, overhead=lambda c: fixed
    ) == choose_micro_batches(seconds, total)


def test_a_slow_rank_whose_rows_cost_more_gets_fewer_slots() -> None:
    # 2:1 speeds, 12 slots; each row rank 1 sends beyond 3 costs 0.3 s: 9,3 beats 8,4
    # (1.8 + 0 against 1.6 + 0.3) and 10,2 (2.0).
    def overhead(c: tuple[int, ...]) -> float:
        return 0.3 * max(0, rows_sent(c) - 3)

    assert choose_micro_batches([0.2, 0.4], 12, overhead=overhead) == (9, 3)
    assert choose_micro_batches([0.2, 0.4], 12, overhead=lambda c: 0.01 * rows_sent(c)) == (8, 4)
