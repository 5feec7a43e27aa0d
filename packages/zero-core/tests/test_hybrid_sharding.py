"""Hybrid sharding (MiCS / HSDP): N = R x S ranks, states over S, replicated R times.

The property: with a deterministic communicator every R x S equals flat sharding, and so
stage 0, bit for bit after every step (zero_comm.hierarchy carries the world-rank-order
fold across the replicas). Model states per rank are those of flat sharding over S ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    assert_same_states,
    build_engine,
    loss_of,
    micro_batch,
    normalised,
    parity_cases,
    train,
)
from test_checkpoint import CASE as CKPT_CASE
from test_checkpoint import logical_state, run_steps

from zero_comm import Communicator, run_simulated
from zero_core import ZeroConfig
from zero_core.hybrid_sharding import hierarchy_sizes


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


@st.composite
def hpz_shapes(draw: st.DrawFn) -> tuple[int, int | None, int]:
    """(N, shard group or None, hpZ group): hpZ's group divides the shard group; it may
    be the whole shard group, where hpZ has no effect."""
    n = draw(st.sampled_from([4, 6, 8]))
    shard = draw(st.sampled_from([None, *[d for d in range(4, n) if n % d == 0]]))
    base = shard or n
    return n, shard, draw(st.sampled_from([d for d in range(2, base + 1) if base % d == 0]))


@settings(max_examples=15, deadline=None)
@given(case=parity_cases(), shape=hpz_shapes(), deferred=st.booleans())
def test_hpz_equals_stage_0_bit_for_bit(
    case: ParityCase, shape: tuple[int, int | None, int], deferred: bool
) -> None:
    n, shard, hpz = shape
    extra = {"shard_group_size": shard, "hpz_partition_size": hpz}

    def body(comm: Communicator) -> None:
        assert_same_states(train(case, comm, 0), train(case, comm, 3, settings=extra), str(shape))

    run_simulated(n, body, defer_outputs=deferred)


@given(
    n=st.integers(1, 12),
    shard=st.one_of(st.none(), st.integers(1, 12)),
    hpz=st.integers(1, 12),
    qgz=st.booleans(),
)
def test_hierarchy_sizes_accept_what_the_engine_builds(
    n: int, shard: int | None, hpz: int, qgz: bool
) -> None:
    """hierarchy_sizes (what zero-train and zero-estimate check before launch) accepts
    exactly the sizes that tile the ranks, and turns an hpZ group as large as the shard
    group into hpZ off, with a note: it would be the primary partition again."""
    config = ZeroConfig(
        stage=3, shard_group_size=shard, hpz_partition_size=hpz,
        quantize_gradients="int4" if qgz else None,
    )  # fmt: skip
    group = shard or n
    tiles = group <= n and n % group == 0 and group % hpz == 0
    if not tiles or (qgz and group < n):
        with pytest.raises(ValueError, match=r"shard_group_size|hpz_partition_size"):
            hierarchy_sizes(config, n)
        return
    sizes = hierarchy_sizes(config, n)
    assert sizes.shard_group == group
    assert sizes.hpz == (1 if hpz == group else hpz)
    assert bool(sizes.note) == (1 < hpz == group)


def test_hpz_over_the_whole_shard_group_runs_as_flat_and_says_so_once() -> None:
    """DeepSpeed's ZeRO++ tutorial value on one node (hpZ = the ranks): it trains, bit for
    bit as without hpZ, and rank 0 alone warns that it has no effect."""
    case = ParityCase()

    def body(comm: Communicator) -> bool:
        engine = build_engine(case, comm, 3, {"hpz_partition_size": 2})
        assert_same_states(train(case, comm, 0), train(case, comm, 3, settings={
            "hpz_partition_size": 2}), "hpZ = world")  # fmt: skip
        return engine.secondary is None

    # Recorded around the whole world (warnings' filters are process-wide; the ranks are
    # threads): two engines with hpZ are built per rank, and rank 0 alone says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_simulated(2, body) == [True, True]
    assert len([w for w in caught if "has no effect" in str(w.message)]) == 2


def test_hpz_backward_gathers_stay_in_its_group() -> None:
    """4 ranks, hpZ over 2: the world all-gathers forward only; backward gathers the same
    elements inside the pairs. Without hpZ the world gathers both."""
    case = ParityCase(widths=(37, 300, 129, 5), dtype="bfloat16", optimizer="adam",
                      bucket_numel=20_000)  # fmt: skip

    def gathered(comm: Communicator, hpz: int) -> tuple[int, int, object, object]:
        engine = build_engine(case, comm, 3, {"hpz_partition_size": hpz})
        x, t = micro_batch(case, comm.rank)
        engine(x.to(torch.bfloat16))  # the first forward records the order
        comm.stats.reset()
        if engine.secondary is not None:
            engine.secondary.stats.reset()
        engine.backward(loss_of(case, engine(x.to(torch.bfloat16)), t))
        secondary = engine.secondary
        pair = 0 if secondary is None else secondary.stats["all_gather"].buffer_elements
        link = (None, None) if secondary is None else (
            secondary.stats.intra_node_bytes, secondary.stats.inter_node_bytes
        )  # fmt: skip
        return comm.stats["all_gather"].buffer_elements, pair, *link

    # 2 nodes of 2 ranks: the hpZ pairs are the nodes.
    hpz_ranks = run_simulated(4, lambda comm: gathered(comm, 2), ranks_per_node=2)
    (world_flat, none, *_), *_ = run_simulated(4, lambda comm: gathered(comm, 1))
    world_hpz, pair, _, _ = hpz_ranks[0]
    assert none == 0 and pair > 0
    assert world_hpz == pair and world_flat == 2 * pair
    # The stats show it: the backward gathers send intra-node bytes only, none across.
    assert all(intra > 0 and inter == 0 for _, _, intra, inter in hpz_ranks)


@settings(max_examples=6, deadline=None)
@given(case=parity_cases(), shape=st.sampled_from([(4, 2, None), (8, 2, 4), (6, 3, None)]))
def test_the_hierarchical_gather_equals_stage_0_bit_for_bit(
    case: ParityCase, shape: tuple[int, int, int | None]
) -> None:
    """(ranks, ranks per node, shard group): stage 3's gathers across nodes, then inside."""
    n, per_node, shard = shape
    extra = {"shard_group_size": shard, "hierarchical_gather": True}

    def body(comm: Communicator) -> None:
        assert_same_states(train(case, comm, 0), train(case, comm, 3, settings=extra), str(shape))

    run_simulated(n, body, ranks_per_node=per_node)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_native_sums_cross_the_replicas_once_per_accumulation_boundary(stage: int) -> None:
    """MiCS / HSDP: with a native communicator and 3 micro-steps per step, the replica
    group runs one all_reduce per step (none per micro-step), and the update is flat
    sharding's up to the order of the sum."""
    case = ParityCase(widths=(37, 120, 9), accumulation=3, steps=2, bucket_numel=2_000)

    def body(comm: Communicator) -> tuple[list[int], bool]:
        engine = build_engine(case, comm, stage, {"shard_group_size": 2})
        assert engine.hybrid is not None
        calls = []
        for step in range(case.steps):
            engine.hybrid.replica.stats.reset()
            for micro in range(case.accumulation):
                x, t = micro_batch(case, (step * case.accumulation + micro) * 4 + comm.rank)
                engine.backward(loss_of(case, engine(x), t))
                replica = engine.hybrid.replica.stats
                if micro < case.accumulation - 1:
                    assert replica.total_volume_bytes == 0, "summed before the boundary"
                engine.step()
            calls.append(engine.hybrid.replica.stats["all_reduce"].calls)
        state = engine.full_state_dict()
        engine.close()
        flat = train(case, comm, stage)[-1]
        close = all(torch.allclose(state[k], flat[k], rtol=1e-5, atol=1e-6) for k in flat)
        return calls, close

    results = run_simulated(4, body, deterministic=False)
    shard_numel_pieces = results[0][0][0]
    assert shard_numel_pieces >= 1
    assert all(calls == [shard_numel_pieces] * 2 for calls, _ in results)
    assert all(close for _, close in results)
