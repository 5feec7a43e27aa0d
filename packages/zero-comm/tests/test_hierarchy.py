"""zero_comm.hierarchy: the two-level reduction equals the flat rank-order fold, exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import Communicator, run_simulated
from zero_comm.hierarchy import HybridGroups, hierarchical_all_gather


def spread_values(rank: int, numel: int, seed: int) -> torch.Tensor:
    """Values over many magnitudes, so that the order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g) * 10.0 ** torch.randint(-4, 4, (numel,), generator=g)


@settings(max_examples=30, deadline=None)
@given(
    n=st.sampled_from([2, 3, 4, 6, 8]),
    data=st.data(),
    chunk=st.integers(1, 40),
    piece=st.integers(1, 50),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_equals_the_flat_reduce_scatter_at_every_factorisation(
    n: int, data: st.DataObject, chunk: int, piece: int, dtype: torch.dtype, seed: int
) -> None:
    s = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))

    def body(comm: Communicator) -> bool:
        x = spread_values(comm.rank, chunk * n, seed).to(dtype)
        flat = torch.empty(chunk, dtype=dtype)
        comm.reduce_scatter(flat, x)
        whole = torch.empty(chunk * n, dtype=dtype)
        comm.all_gather(whole, flat)
        groups = HybridGroups(comm, s, piece_numel=piece)
        mine = torch.empty(chunk * n // s, dtype=dtype)
        groups.reduce_scatter(mine, x).wait()
        return torch.equal(mine, whole.view(s, -1)[groups.shard.rank])

    assert all(run_simulated(n, body, deterministic=True))


def test_native_grouped_sums_differ_so_the_test_can_fail() -> None:
    def body(comm: Communicator) -> bool:
        x = spread_values(comm.rank, 600, 7)
        flat = torch.empty(100)
        comm.reduce_scatter(flat, x)
        whole = torch.empty(600)
        comm.all_gather(whole, flat)
        groups = HybridGroups(comm, 3)
        mine = torch.empty(200)
        groups.reduce_scatter(mine, x).wait()
        return torch.equal(mine, whole.view(3, -1)[groups.shard.rank])

    assert run_simulated(6, body, deterministic=True) == [True] * 6
    assert run_simulated(6, body, deterministic=False) != [True] * 6


def test_a_size_that_does_not_divide_is_named() -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(
            ValueError, match=r"does not divide the 6 ranks; use one of \[1, 2, 3, 6\]"
        ):
            HybridGroups(comm, 4)

    run_simulated(6, body)


@settings(max_examples=20, deadline=None)
@given(
    shape=st.sampled_from([(2, 2), (2, 3), (3, 2), (4, 2), (2, 4), (1, 4), (4, 1)]),
    part=st.integers(0, 9),
)
def test_the_hierarchical_gather_equals_the_flat_one(shape: tuple[int, int], part: int) -> None:
    """k nodes x P ranks: across nodes, then inside, then reordered: the flat result."""
    nodes, per_node = shape

    def body(comm: Communicator) -> bool:
        mine = spread_values(comm.rank, part, 3)
        flat, hierarchical = (
            torch.empty(part * comm.world_size),
            torch.empty(part * comm.world_size),
        )
        comm.all_gather(flat, mine)
        hierarchical_all_gather(comm, hierarchical, mine).wait()
        return torch.equal(flat, hierarchical)

    assert all(run_simulated(nodes * per_node, body, ranks_per_node=per_node))
