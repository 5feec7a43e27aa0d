"""Coalesced gradient reductions (grad_reducer, ``coalesce_numel``): consecutive buckets
reduced by one collective, with the same bits as one collective per bucket.

The bits against stage 0 are the hypothesis parity suite's (parity_cases draws
``coalesce_numel``); here: how buckets are grouped, that the grouping takes effect, and
that qgZ, whose blocks could have moved, gives the same bits coalesced or not."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from parity import ParityCase, assert_same_states, build_engine, loss_of, micro_batch, train

from zero_comm import Communicator, run_simulated
from zero_core.coalescing import coalesced_groups


@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    alone_flags=st.lists(st.booleans(), min_size=12, max_size=12),
    kind_draws=st.none() | st.lists(st.integers(0, 2), min_size=12, max_size=12),
    limit=st.integers(0, 120),
    reverse=st.booleans(),
)
def test_groups_are_greedy_runs_in_launch_order(
    numels: list[int],
    alone_flags: list[bool],
    kind_draws: list[int] | None,
    limit: int,
    reverse: bool,
) -> None:
    """coalescing.coalesced_groups, the rule of gradient reductions and of stage 3's
    gathers (which also pass kinds: the way each unit is gathered)."""
    order = list(range(len(numels)))[:: -1 if reverse else 1]
    alone = alone_flags[: len(numels)]
    kinds = None if kind_draws is None else kind_draws[: len(numels)]
    groups = coalesced_groups(order, numels, alone, limit, kinds)
    assert [index for group in groups for index in group] == order
    for group in groups:
        if len(group) > 1:
            assert not any(alone[index] for index in group)
            assert sum(numels[index] for index in group) <= limit
            assert kinds is None or len({kinds[index] for index in group}) == 1
    for before, after in itertools.pairwise(groups):
        head = after[0]
        # a group ends only where the next bucket could not have joined it
        assert (
            alone[head]
            or alone[before[0]]
            or sum(numels[index] for index in before) + numels[head] > limit
            or (kinds is not None and kinds[head] != kinds[before[0]])
        )


# Stage 3: a unit per Linear weight (biases stay whole), so every bucket is one unit.
CASE = ParityCase(widths=(24, 40, 40, 40, 24), dtype="float32", optimizer="adam", steps=2,
                  bucket_numel=4000, persistence_threshold=64, seed=5)  # fmt: skip


Reduced = tuple[int, list[list[int]], list[int]]


def reduce_scatters_per_backward(coalesce_numel: int) -> Reduced:
    """Stage 3 on 3 ranks: reduce-scatters in one backward, the groups, bucket sizes."""
    case = ParityCase(**{**CASE.__dict__, "coalesce_numel": coalesce_numel})

    def body(comm: Communicator) -> Reduced:
        engine = build_engine(case, comm, 3)
        x, target = micro_batch(case, comm.rank)
        comm.stats.reset()
        engine.backward(loss_of(case, engine(x), target))
        calls = comm.stats["reduce_scatter"].calls
        reducer = engine.gradients.reducer
        groups, numels = reducer.groups, [bucket.padded_numel for bucket in reducer.buckets]
        engine.close()
        return calls, groups, numels

    return run_simulated(3, body)[0]


def test_coalescing_makes_fewer_reduce_scatters_within_bucket_numel() -> None:
    alone, alone_groups, _ = reduce_scatters_per_backward(0)
    # 4 weight units (960, 1600, 1600, 960 elements) and the persistent biases
    assert alone == len(alone_groups) == 5
    calls, groups, numels = reduce_scatters_per_backward(1 << 20)  # capped at bucket_numel
    assert calls == len(groups) < alone
    assert sorted(index for group in groups for index in group) == list(range(5))
    assert all(sum(numels[index] for index in group) <= CASE.bucket_numel for group in groups)


def states(settings: dict[str, Any], coalesce_numel: int) -> list[dict[str, torch.Tensor]]:
    case = ParityCase(**{**CASE.__dict__, "coalesce_numel": coalesce_numel})
    return run_simulated(4, lambda comm: train(case, comm, 3, settings=settings), ranks_per_node=2)[
        0
    ]


def test_qgz_gives_the_same_bits_coalesced_or_not() -> None:
    """qgZ's blocks start at multiples of GRADIENT_BLOCK_NUMEL in each rank's chunk, and
    every bucket slice is a multiple of BLOCK long, so side by side they quantize as apart."""
    for settings in ({"quantize_gradients": "int4"}, {"quantize_gradients": "int8"}, {}):
        assert_same_states(states(settings, 0), states(settings, 1 << 20), f"{settings}")
