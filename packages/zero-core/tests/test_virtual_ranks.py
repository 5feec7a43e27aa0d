"""VirtualRanks and ZeroConfig.micro_batches_per_rank: what is accepted, what is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core import VirtualRanks, ZeroConfig


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_each_rank_hosts_a_contiguous_block_and_the_blocks_tile_the_virtual_world(
    counts: list[int],
) -> None:
    covered: list[int] = []
    for rank in range(len(counts)):
        v = VirtualRanks(tuple(counts), rank)
        assert v.total == sum(counts)
        assert v.of_rank(rank) == range(v.first, v.first + v.count)
        covered += list(v.of_rank(rank))
    assert covered == list(range(sum(counts)))


def test_config_normalises_a_list_to_a_tuple() -> None:
    assert ZeroConfig(micro_batches_per_rank=[2, 1]).micro_batches_per_rank == (2, 1)
    assert ZeroConfig(micro_batches_per_rank="auto").micro_batches_per_rank == "auto"
    assert ZeroConfig().micro_batches_per_rank is None


@pytest.mark.parametrize("bad", [[2, 0], [1.5, 1], [], "2,1", 3, [True, 1]])
def test_config_refuses_what_is_not_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="micro_batches_per_rank"):
        ZeroConfig(micro_batches_per_rank=bad)  # type: ignore[arg-type]


def _initialize(comm: Communicator, counts: object) -> zero_core.Engine:
    model = torch.nn.Linear(3, 2)
    return zero_core.initialize(
        model, torch.optim.SGD, ZeroConfig(micro_batches_per_rank=counts), comm,
        optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip


def test_counts_must_fit_the_world() -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="3 entries but the data-parallel world has 2"):
            _initialize(comm, [1, 1, 1])

    run_simulated(2, body)


def test_auto_names_who_resolves_it() -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="choose_micro_batches"):
            _initialize(comm, "auto")

    run_simulated(2, body)


def test_a_homogeneous_engine_has_one_virtual_rank_per_rank() -> None:
    def body(comm: Communicator) -> VirtualRanks:
        return _initialize(comm, None).virtual_ranks

    assert run_simulated(3, body) == [VirtualRanks((1, 1, 1), r) for r in range(3)]
