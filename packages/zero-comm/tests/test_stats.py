"""Ring-convention communication volumes, and what a communicator counts (tiers 1 and 2).

Volumes are exact :class:`~fractions.Fraction` s, so every comparison here is ``==``: no
tolerance. The simulated world runs the same :class:`Communicator` code as the real
backends, so what it counts is what gloo, NCCL and MPI count.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import CommStats, Communicator, ReduceOp, ring_volume, run_simulated

REDUCING = ("all_reduce", "reduce_scatter", "all_gather")
DATA_COLLECTIVES = (*REDUCING, "broadcast")
world_sizes = st.integers(1, 64)
numels = st.integers(0, 10**9)


# ------------------------------------------------------------------ ring_volume


@given(world_size=world_sizes, numel=numels)
def test_ring_volume_formulas(world_size: int, numel: int) -> None:
    """all_reduce 2(N-1)/N B, reduce_scatter and all_gather (N-1)/N B, broadcast B."""
    n, b = world_size, numel
    assert ring_volume("all_reduce", b, n) == Fraction(2 * (n - 1) * b, n)
    assert ring_volume("reduce_scatter", b, n) == Fraction((n - 1) * b, n)
    assert ring_volume("all_gather", b, n) == Fraction((n - 1) * b, n)
    assert ring_volume("broadcast", b, n) == (b if n > 1 else 0)
    assert ring_volume("barrier", b, n) == 0
    for name in (*DATA_COLLECTIVES, "barrier"):
        assert isinstance(ring_volume(name, b, n), Fraction)


@given(world_size=world_sizes, numel=numels)
def test_all_reduce_is_reduce_scatter_then_all_gather(world_size: int, numel: int) -> None:
    assert ring_volume("all_reduce", numel, world_size) == ring_volume(
        "reduce_scatter", numel, world_size
    ) + ring_volume("all_gather", numel, world_size)


@given(world_size=world_sizes, a=numels, b=numels)
def test_ring_volume_is_linear_in_the_buffer(world_size: int, a: int, b: int) -> None:
    for name in DATA_COLLECTIVES:
        assert ring_volume(name, a + b, world_size) == ring_volume(
            name, a, world_size
        ) + ring_volume(name, b, world_size)


@given(world_size=st.integers(2, 64), numel=st.integers(1, 10**9))
def test_ring_volume_bounds(world_size: int, numel: int) -> None:
    """On more than one rank a rank sends at least half its buffer and less than all of
    it (all_reduce: less than twice), whatever N; the fraction grows with N."""
    for name, factor in (("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1)):
        volume = ring_volume(name, numel, world_size)
        assert Fraction(factor * numel, 2) <= volume < factor * numel
        assert volume < ring_volume(name, numel, world_size + 1)


@given(numel=numels)
def test_one_rank_moves_nothing(numel: int) -> None:
    for name in (*DATA_COLLECTIVES, "barrier"):
        assert ring_volume(name, numel, 1) == 0


def test_zero_paper_volumes() -> None:
    """ZeRO stages 0-2 move 2Ψ per step (one all_reduce, or a reduce_scatter of the
    gradients and an all_gather of the parameters), stage 3 3Ψ (one more all_gather),
    in the limit of many ranks; at N ranks each is scaled by (N-1)/N."""
    psi, n = 1_000_000, 8
    scale = Fraction(n - 1, n)
    stage2 = ring_volume("reduce_scatter", psi, n) + ring_volume("all_gather", psi, n)
    assert ring_volume("all_reduce", psi, n) == stage2 == 2 * psi * scale
    assert stage2 + ring_volume("all_gather", psi, n) == 3 * psi * scale


def test_unknown_collective_is_rejected() -> None:
    with pytest.raises(KeyError):
        ring_volume("scatter", 8, 2)


# -------------------------------------------------------------------- CommStats


class Call(NamedTuple):
    collective: str
    numel: int
    itemsize: int


calls = st.builds(
    Call,
    st.sampled_from((*DATA_COLLECTIVES, "barrier")),
    st.integers(0, 10**6),
    st.sampled_from([1, 2, 4, 8]),
)


@settings(max_examples=200)
@given(world_size=world_sizes, made=st.lists(calls, max_size=20))
def test_record_sums_calls_elements_and_volumes(world_size: int, made: list[Call]) -> None:
    stats = CommStats(world_size)
    for call in made:
        stats.record(*call)
    for name in CommStats.COLLECTIVES:
        mine = [c for c in made if c.collective == name]
        count = stats[name]
        assert count.calls == len(mine)
        assert count.buffer_elements == sum(c.numel for c in mine)
        assert count.volume_elements == sum(
            (ring_volume(name, c.numel, world_size) for c in mine), Fraction(0)
        )
        assert count.volume_bytes == sum(
            (ring_volume(name, c.numel, world_size) * c.itemsize for c in mine), Fraction(0)
        )
    assert stats.total_volume_elements == sum(
        (stats[n].volume_elements for n in CommStats.COLLECTIVES), Fraction(0)
    )
    assert stats.total_volume_bytes == sum(
        (ring_volume(c.collective, c.numel, world_size) * c.itemsize for c in made), Fraction(0)
    )


@given(world_size=world_sizes, made=st.lists(calls, min_size=1, max_size=10))
def test_reset_starts_every_counter_again(world_size: int, made: list[Call]) -> None:
    stats = CommStats(world_size)
    for call in made:
        stats.record(*call)
    before = stats[made[0].collective]
    stats.reset()
    for name in CommStats.COLLECTIVES:
        assert stats[name].calls == 0
        assert stats[name].buffer_elements == 0
        assert stats[name].volume_elements == 0
        assert stats[name].volume_bytes == 0
    assert stats.total_volume_bytes == 0
    assert stats.total_volume_elements == 0
    # A count taken before the reset is a snapshot: reset does not zero it in place.
    assert before.calls >= 1
    stats.record(*made[0])
    assert stats[made[0].collective].calls == 1


def test_as_dict_is_a_json_friendly_copy() -> None:
    """Volumes become floats (here 2*3/4*10 = 15 elements, 60 bytes; 3/4*8 = 6, 12)."""
    import json

    stats = CommStats(4)
    stats.record("all_reduce", 10, 4)
    stats.record("all_gather", 8, 2)
    snapshot = stats.as_dict()
    assert set(snapshot) == set(CommStats.COLLECTIVES)
    assert snapshot["all_reduce"] == {
        "calls": 1,
        "buffer_elements": 10,
        "volume_elements": 15.0,
        "volume_bytes": 60.0,
        "intra_node_bytes": 60.0,
        "inter_node_bytes": 0.0,
    }
    assert snapshot["all_gather"] == {
        "calls": 1,
        "buffer_elements": 8,
        "volume_elements": 6.0,
        "volume_bytes": 12.0,
        "intra_node_bytes": 12.0,
        "inter_node_bytes": 0.0,
    }
    assert snapshot["broadcast"] == {
        "calls": 0,
        "buffer_elements": 0,
        "volume_elements": 0.0,
        "volume_bytes": 0.0,
        "intra_node_bytes": 0.0,
        "inter_node_bytes": 0.0,
    }
    assert json.loads(json.dumps(snapshot)) == snapshot
    for row in snapshot.values():
        assert all(type(v) in (int, float) for v in row.values())
    # A copy: recording afterwards does not change it.
    stats.record("all_reduce", 10, 4)
    assert snapshot["all_reduce"]["calls"] == 1


def test_as_dict_float_of_a_non_integral_volume() -> None:
    """1 element on 3 ranks: all_reduce 4/3, which as_dict rounds to the nearest float."""
    stats = CommStats(3)
    stats.record("all_reduce", 1, 2)
    assert stats["all_reduce"].volume_elements == Fraction(4, 3)
    assert stats.as_dict()["all_reduce"]["volume_elements"] == float(Fraction(4, 3))
    assert stats.as_dict()["all_reduce"]["volume_bytes"] == float(Fraction(8, 3))


# ------------------------------------------------------- through a communicator


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


class Snapshot(NamedTuple):
    calls: int
    buffer_elements: int
    volume_elements: Fraction
    volume_bytes: Fraction


def snapshot(comm: Communicator) -> dict[str, Snapshot]:
    return {
        name: Snapshot(
            comm.stats[name].calls,
            comm.stats[name].buffer_elements,
            comm.stats[name].volume_elements,
            comm.stats[name].volume_bytes,
        )
        for name in CommStats.COLLECTIVES
    }


def call_collective(comm: Communicator, name: str, numel: int, dtype: torch.dtype) -> int:
    """Run collective ``name`` on a buffer of ``numel`` elements; return the buffer's numel
    as the formula counts it (all_gather: its output; reduce_scatter: its input)."""
    n = comm.world_size
    if name == "all_reduce":
        comm.all_reduce(torch.ones(numel, dtype=dtype))
        return numel
    if name == "reduce_scatter":
        chunk = -(-numel // n)
        comm.reduce_scatter(torch.empty(chunk, dtype=dtype), torch.ones(chunk * n, dtype=dtype))
        return chunk * n
    if name == "all_gather":
        chunk = -(-numel // n)
        comm.all_gather(torch.empty(chunk * n, dtype=dtype), torch.ones(chunk, dtype=dtype))
        return chunk * n
    comm.broadcast(torch.ones(numel, dtype=dtype), src=n - 1)
    return numel


def expected_counts(
    world_size: int, name: str, buffer: int, itemsize: int, rank: int
) -> dict[str, Snapshot]:
    """``call_collective``'s broadcast comes from rank N-1, so rank N-2 (whose ring
    successor is the root) forwards nothing."""
    zero = Snapshot(0, 0, Fraction(0), Fraction(0))
    out = {c: zero for c in CommStats.COLLECTIVES}
    volume = ring_volume(name, buffer, world_size)
    if name == "broadcast" and world_size > 1 and rank == world_size - 2:
        volume = Fraction(0)
    out[name] = Snapshot(1, buffer, volume, volume * itemsize)
    return out


@settings(max_examples=150, deadline=None)
@given(
    world_size=st.integers(1, 4),
    name=st.sampled_from(DATA_COLLECTIVES),
    numel=st.integers(0, 37),
    dtype=st.sampled_from(sorted(DTYPES)),
    deterministic=st.booleans(),
    check_consistency=st.booleans(),
)
def test_a_collective_counts_exactly_its_formula(
    world_size: int,
    name: str,
    numel: int,
    dtype: str,
    deterministic: bool,
    check_consistency: bool,
) -> None:
    """Only the collective that was called is counted, once, with the ring formula: not
    the consistency check's all_gather, nor the all_to_all and all_gather inside a
    rank-ordered (deterministic) all_reduce. Every rank counts the same, but for a
    broadcast's last rank in the ring from the root."""
    torch_dtype = DTYPES[dtype]

    def body(comm: Communicator) -> tuple[int, dict[str, Snapshot]]:
        buffer = call_collective(comm, name, numel, torch_dtype)
        return buffer, snapshot(comm)

    results = run_simulated(
        world_size, body, deterministic=deterministic, check_consistency=check_consistency
    )
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    for rank, (buffer, counts) in enumerate(results):
        assert counts == expected_counts(world_size, name, buffer, itemsize, rank)


def test_counts_of_a_known_sequence() -> None:
    """3 ranks, float32 (4 bytes): all_reduce of 12 -> 2*2/3*12 = 16 elements, 64 bytes;
    reduce_scatter of 12 -> 8, 32; all_gather of 12 -> 8, 32; all_to_all of 6 -> 4, 16;
    broadcast of 5 from 0 -> 5, 20 (0 on rank 2, whose ring successor is the root);
    two all_reduces of 12 -> 32, 128. async handles are counted when called."""

    def body(comm: Communicator) -> dict[str, Snapshot]:
        grads = torch.arange(12, dtype=torch.float32)
        comm.all_reduce(grads, ReduceOp.AVG)
        handle = comm.all_reduce(grads, async_op=True)
        handle.wait()
        comm.reduce_scatter(torch.empty(4), torch.ones(12))
        comm.all_gather(torch.empty(12), torch.ones(4))
        comm.all_to_all(torch.empty(6), torch.ones(6))
        comm.broadcast(torch.ones(5), src=0)
        comm.barrier()
        return snapshot(comm)

    for rank, counts in enumerate(run_simulated(3, body)):
        forwarded = Fraction(0) if rank == 2 else Fraction(5)
        assert counts == {
            "all_reduce": Snapshot(2, 24, Fraction(32), Fraction(128)),
            "reduce_scatter": Snapshot(1, 12, Fraction(8), Fraction(32)),
            "all_gather": Snapshot(1, 12, Fraction(8), Fraction(32)),
            "all_to_all": Snapshot(1, 6, Fraction(4), Fraction(16)),
            "broadcast": Snapshot(1, 5, forwarded, forwarded * 4),
            "barrier": Snapshot(1, 0, Fraction(0), Fraction(0)),
        }


def test_non_integral_volume_is_exact() -> None:
    """7 elements on 3 ranks: all_reduce 2*2/3*7 = 28/3 elements, not 9.333...; in
    bfloat16 (2 bytes) 56/3 bytes."""

    def body(comm: Communicator) -> tuple[Fraction, Fraction]:
        comm.all_reduce(torch.ones(7, dtype=torch.bfloat16))
        return comm.stats["all_reduce"].volume_elements, comm.stats["all_reduce"].volume_bytes

    assert run_simulated(3, body) == [(Fraction(28, 3), Fraction(56, 3))] * 3


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_object_collectives_are_not_counted(world_size: int) -> None:
    """broadcast_object and all_gather_object move pickles through the primitives, not
    through the counted collectives."""

    def body(comm: Communicator) -> tuple[object, list[object], dict[str, Snapshot]]:
        got = comm.broadcast_object({"step": 3, "rank": comm.rank}, src=0)
        everyone = comm.all_gather_object(("rank", comm.rank, "x" * comm.rank))
        return got, everyone, snapshot(comm)

    zero = Snapshot(0, 0, Fraction(0), Fraction(0))
    for got, everyone, counts in run_simulated(world_size, body):
        assert got == {"step": 3, "rank": 0}
        assert everyone == [("rank", r, "x" * r) for r in range(world_size)]
        assert counts == {name: zero for name in CommStats.COLLECTIVES}


def test_split_groups_count_on_their_own_communicator() -> None:
    """4 ranks split into two pairs; an all_reduce of 6 in a pair is 2*1/2*6 = 6 elements on
    the pair's communicator and nothing on the parent; split itself is not counted."""

    def body(comm: Communicator) -> tuple[dict[str, Snapshot], dict[str, Snapshot]]:
        pair = comm.split(color=comm.rank // 2)
        pair.all_reduce(torch.ones(6))
        return snapshot(comm), snapshot(pair)

    zero = Snapshot(0, 0, Fraction(0), Fraction(0))
    for parent, pair in run_simulated(4, body):
        assert parent == {name: zero for name in CommStats.COLLECTIVES}
        assert pair["all_reduce"] == Snapshot(1, 6, Fraction(6), Fraction(24))


def test_reset_through_a_communicator() -> None:
    def body(comm: Communicator) -> tuple[int, int]:
        comm.all_reduce(torch.ones(4))
        before = comm.stats["all_reduce"].calls
        comm.stats.reset()
        comm.all_gather(torch.empty(4), torch.ones(2))
        return before, comm.stats["all_reduce"].calls

    assert run_simulated(2, body) == [(1, 0), (1, 0)]


def test_all_to_all_moves_every_chunk_but_its_own() -> None:
    assert ring_volume("all_to_all", 12, 3) == 8
    assert ring_volume("all_to_all", 12, 1) == 0


@given(world_size=world_sizes, made=st.lists(calls, max_size=20))
def test_on_one_node_every_byte_is_intra_node(world_size: int, made: list[Call]) -> None:
    """The default topology (one node): the split adds up and nothing crosses nodes.
    Other topologies: tests/test_topology.py."""
    stats = CommStats(world_size, rank=world_size - 1)
    for call in made:
        stats.record(*call)
    for name in CommStats.COLLECTIVES:
        assert stats[name].inter_node_bytes == 0
        assert stats[name].intra_node_bytes == stats[name].volume_bytes
    assert stats.intra_node_bytes == stats.total_volume_bytes
    assert stats.inter_node_bytes == 0
