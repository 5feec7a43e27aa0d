"""Hybrid sharding (MiCS / HSDP): N = R x S ranks, states over S, replicated R times.

The property: with a deterministic communicator every R x S equals flat sharding, and so
stage 0, bit for bit after every step (zero_comm.hierarchy carries the world-rank-order
fold across the replicas). Model states per rank are those of flat sharding over S ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    assert_same_states,
    build_engine,
    normalised,
    parity_cases,
    train,
)
from test_checkpoint import CASE as CKPT_CASE
from test_checkpoint import logical_state, run_steps

from zero_comm import Communicator, run_simulated
from zero_core import ZeroConfig


@st.composite
def factorisations(draw: st.DrawFn) -> tuple[int, int]:
    """(N, S) with N <= 8 and S a proper divisor of N (S = N is flat sharding)."""
    n = draw(st.sampled_from([2, 3, 4, 6, 8]))
    return n, draw(st.sampled_from([d for d in range(1, n) if n % d == 0]))


@settings(max_examples=25, deadline=None)
@given(
    case=parity_cases(),
    shape=factorisations(),
    stage=st.sampled_from([1, 2, 3]),
    deferred=st.booleans(),
)
def test_every_factorisation_equals_stage_0_bit_for_bit(
    case: ParityCase, shape: tuple[int, int], stage: int, deferred: bool
) -> None:
    n, s = shape

    def body(comm: Communicator) -> None:
        reference = train(case, comm, 0)
        hybrid = train(case, comm, stage, settings={"shard_group_size": s})
        assert_same_states(reference, hybrid, f"stage {stage}, {n // s} x {s}")

    run_simulated(n, body, defer_outputs=deferred)


def test_the_comparison_can_fail_with_native_sums() -> None:
    """Native (grouped) sums at 2 x 3 differ from the flat fold: the equality is not vacuous."""
    case = ParityCase(widths=(64, 130, 33), steps=1, seed=3, bucket_numel=300)

    def body(comm: Communicator) -> bool:
        a = train(case, comm, 0)
        b = train(case, comm, 2, settings={"shard_group_size": 3})
        return all(torch.equal(a[0][k], b[0][k]) for k in a[0])

    assert run_simulated(6, body, deterministic=False) != [True] * 6
    assert run_simulated(6, body, deterministic=True) == [True] * 6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_states_per_rank_are_flat_sharding_over_the_shard_group(stage: int) -> None:
    """4 = 2 x 2: every rank's report equals that of flat sharding over 2 ranks, which
    test_memory_and_traffic holds to the paper's formulas; and it is less than at 4."""
    case = ParityCase(widths=(37, 300, 129, 5), dtype="bfloat16", optimizer="adam",
                      bucket_numel=20_000)  # fmt: skip

    def report(comm: Communicator, size: int | None) -> tuple[int, int, int, int]:
        engine = build_engine(case, comm, stage, {"shard_group_size": size})
        r = engine.memory_report()
        engine.close()
        return r.parameters, r.gradients, r.master_weights, r.optimizer_states

    hybrid = run_simulated(4, lambda comm: report(comm, 2))
    flat_two = run_simulated(2, lambda comm: report(comm, None))
    flat_four = run_simulated(4, lambda comm: report(comm, None))
    assert set(hybrid) == set(flat_two), (hybrid, flat_two)
    assert sum(hybrid[0]) > sum(flat_four[0])


def test_a_shard_group_that_does_not_divide_the_world_is_named() -> None:
    case = ParityCase()

    def body(comm: Communicator) -> None:
        with pytest.raises(
            ValueError, match=r"shard_group_size=4 does not divide the 6 .*\[1, 2, 3, 6\]"
        ):
            build_engine(case, comm, 3, {"shard_group_size": 4})

    run_simulated(6, body)


def test_stage_0_refuses_a_shard_group() -> None:
    with pytest.raises(ValueError, match="stage 1 or more"):
        ZeroConfig(stage=0, shard_group_size=2)


@pytest.mark.parametrize(
    ("before", "after"),
    [((4, 2, 3), (2, None, 2)), ((2, None, 3), (6, 3, 1)), ((6, 2, 2), (4, 2, 3))],
)
def test_a_checkpoint_reshards_between_hybrid_and_flat(
    before: tuple[int, int | None, int], after: tuple[int, int | None, int], tmp_path: Path
) -> None:
    """(ranks, shard group, stage) saved, then loaded by another: the logical state is
    bit-identical, and training goes on as stage 0 loaded from the same file does."""
    case = normalised(CKPT_CASE)
    (n, s, stage), (m, t, next_stage) = before, after

    def save_body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage, {"shard_group_size": s})
        run_steps(engine, case, comm, 0, 2)
        engine.save(tmp_path / "first")

    def load_body(comm: Communicator) -> None:
        engine = build_engine(case, comm, next_stage, {"shard_group_size": t})
        engine.load(tmp_path / "first")
        engine.save(tmp_path / "again")
        run_steps(engine, case, comm, 2, 1)
        oracle = build_engine(case, comm, 0)
        oracle.load(tmp_path / "first")
        run_steps(oracle, case, comm, 2, 1)
        state, expected = engine.full_state_dict(), oracle.full_state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)

    run_simulated(n, save_body)
    run_simulated(m, load_body)
    first, again = logical_state(tmp_path / "first"), logical_state(tmp_path / "again")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
