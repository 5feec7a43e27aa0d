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
