"""The collective properties on an in-process simulated world (tier 2: fast, many examples).

The same :func:`check_case` runs on real gloo and MPI ranks in tests/distributed. Here
hypothesis draws world sizes 1-4 (odd ones included) as well as the cases.
"""

from __future__ import annotations

import functools
import operator
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import (
    CollectiveMismatchError,
    CommError,
    Communicator,
    ReduceOp,
    run_simulated,
)
from zero_comm.simulated import SimulatedRankError
from zero_comm.testing.properties import (
    CollectiveCase,
    check_case,
    check_mismatch_is_named,
    collective_cases,
    rank_input,
)

world_sizes = st.integers(1, 4)


@settings(max_examples=300, deadline=None)
@given(world_size=world_sizes, case=collective_cases())
def test_deterministic_collectives_equal_their_definition_bit_for_bit(
    world_size: int, case: CollectiveCase
) -> None:
    run_simulated(world_size, lambda comm: check_case(comm, case), deterministic=True)


@settings(max_examples=150, deadline=None)
@given(world_size=world_sizes, case=collective_cases())
def test_native_collectives_equal_their_definition_within_rounding(
    world_size: int, case: CollectiveCase
) -> None:
    run_simulated(world_size, lambda comm: check_case(comm, case), deterministic=False)


def test_native_order_differs_from_rank_order_at_three_ranks() -> None:
    """The simulated native sum adds in ring order, so it is not rank order: if it were,
    the deterministic tests above could not tell the two modes apart."""
    case = CollectiveCase("all_reduce", 4096, "float32", seed=7)
    inputs = [rank_input(case, r, 3) for r in range(3)]
    ordered = functools.reduce(operator.add, inputs)

    def body(comm: Communicator) -> torch.Tensor:
        mine = rank_input(case, comm.rank, 3)
        comm.all_reduce(mine)
        return mine

    native = run_simulated(3, body, deterministic=False)[0]
    assert not torch.equal(native, ordered)
    assert torch.equal(run_simulated(3, body, deterministic=True)[0], ordered)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_mismatched_numel_or_dtype_raises_on_every_rank(world_size: int) -> None:
    run_simulated(world_size, check_mismatch_is_named)


def test_mismatched_collective_kind_is_named() -> None:
    def body(comm: Communicator) -> str:
        try:
            if comm.rank == 0:
                comm.all_reduce(torch.ones(4))
            else:
                comm.broadcast(torch.ones(4), src=0)
        except CollectiveMismatchError as exc:
            return str(exc)
        return ""

    messages = run_simulated(2, body)
    assert all("all_reduce" in m and "broadcast" in m for m in messages), messages


def test_a_rank_that_raises_releases_the_others_and_is_named() -> None:
    def body(comm: Communicator) -> None:
        if comm.rank == 1:
            raise ValueError("boom on rank 1")
        comm.all_reduce(torch.ones(3))

    with pytest.raises(SimulatedRankError, match=r"rank 1 of 3 failed: ValueError\('boom"):
        run_simulated(3, body, timeout=30)


def test_a_rank_that_skips_a_collective_times_out_with_the_missing_rank() -> None:
    def body(comm: Communicator) -> None:
        if comm.rank != 2:
            comm.all_reduce(torch.ones(3))

    with pytest.raises(SimulatedRankError) as info:
        run_simulated(3, body, timeout=0.5)
    assert isinstance(info.value.__cause__, CommError)
    assert "never arrived" in str(info.value) and "[2]" in str(info.value)


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(2, 4), tp=st.integers(1, 4), case=collective_cases())
def test_split_groups_behave_like_worlds_of_their_own(
    world_size: int, tp: int, case: CollectiveCase
) -> None:
    """Rows and columns of a tp x dp mesh: each subgroup satisfies the same properties."""

    def body(comm: Communicator) -> tuple[int, int, int, int]:
        row = comm.split(color=comm.rank // tp)
        column = comm.split(color=comm.rank % tp)
        check_case(row, case)
        check_case(column, case)
        return row.rank, row.world_size, column.rank, column.world_size

    for rank, (row_rank, row_size, col_rank, col_size) in enumerate(
        run_simulated(world_size, body)
    ):
        assert row_rank == rank % tp
        assert row_size == min(tp, world_size - (rank // tp) * tp)
        assert col_rank == rank // tp
        assert col_size == len(range(rank % tp, world_size, tp))


def test_split_orders_ranks_by_key() -> None:
    def body(comm: Communicator) -> int:
        return comm.split(color=0, key=-comm.rank).rank

    assert run_simulated(3, body) == [2, 1, 0]


@settings(max_examples=50, deadline=None)
@given(
    world_size=world_sizes,
    src=st.integers(0, 3),
    payload=st.recursive(
        st.none() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=10,
    ),
)
def test_object_collectives(world_size: int, src: int, payload: object) -> None:
    src %= world_size

    def body(comm: Communicator) -> tuple[object, list[object]]:
        mine = (comm.rank, payload)
        return comm.broadcast_object(mine, src), comm.all_gather_object(mine)

    for got_broadcast, got_gather in run_simulated(world_size, body):
        assert got_broadcast == (src, payload)
        assert got_gather == [(r, payload) for r in range(world_size)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.all_reduce(torch.ones(4)[::2]), "contiguous"),
        (lambda c: c.all_reduce(torch.ones(4, dtype=torch.complex64)), "dtype"),
        (lambda c: c.all_reduce(torch.ones(4, dtype=torch.int64), ReduceOp.AVG), "AVG"),
        (lambda c: c.reduce_scatter(torch.empty(3), torch.empty(7)), "equal chunks"),
        (lambda c: c.reduce_scatter(torch.empty(3), torch.empty(8)), "output must hold"),
        (lambda c: c.all_gather(torch.empty(7), torch.empty(3)), "output must hold"),
        (lambda c: c.all_gather(torch.empty(6, dtype=torch.float16), torch.empty(3)), "must match"),
        (lambda c: c.broadcast(torch.empty(3), src=5), "src=5"),
        (lambda c: c.all_reduce(torch.ones(2), "sum"), "ReduceOp"),
        (lambda c: c.split(color=-1), "color"),
    ],
)
def test_bad_arguments_are_named_before_any_communication(call, message) -> None:  # type: ignore[no-untyped-def]
    def body(comm: Communicator) -> None:
        with pytest.raises((TypeError, ValueError), match=message) as info:
            call(comm)
        assert f"[rank {comm.rank}]" in str(info.value)

    run_simulated(2, body)


def test_async_handles_complete_on_wait_and_tolerate_a_second_wait() -> None:
    def body(comm: Communicator) -> torch.Tensor:
        x = torch.full((10,), float(comm.rank + 1))
        handle = comm.all_reduce(x, async_op=True)
        handle.wait()
        handle.wait()
        assert handle.is_completed()
        return x

    for result in run_simulated(3, body):
        assert torch.equal(result, torch.full((10,), 6.0))


def test_a_closed_communicator_refuses_work() -> None:
    def body(comm: Communicator) -> None:
        comm.close()
        for call in (
            lambda: comm.all_reduce(torch.ones(2)),
            comm.barrier,
            lambda: comm.all_gather_object(1),
            lambda: comm.split(0),
        ):
            with pytest.raises(CommError, match="closed"):
                call()

    run_simulated(2, body)


def test_async_ordered_all_reduces_may_be_waited_in_any_order() -> None:
    """The ordered all-reduce's gather phase runs at wait(); ranks that wait in different
    orders (or issue another collective first) must still pair the right collectives."""

    def body(comm: Communicator) -> tuple[list[float], list[float], list[float]]:
        a = torch.full((4,), 1.0 + comm.rank)
        b = torch.full((4,), 100.0 + comm.rank)
        first = comm.all_reduce(a, async_op=True)
        second = comm.all_reduce(b, async_op=True)
        assert first is not None and second is not None
        if comm.rank % 2:
            second.wait()
            c = torch.ones(2)
            comm.all_reduce(c)
            first.wait()
        else:
            c = torch.ones(2)
            comm.all_reduce(c)
            first.wait()
            second.wait()
        return a.tolist(), b.tolist(), c.tolist()

    for n in (2, 3):
        expected_a = float(sum(1 + r for r in range(n)))
        expected_b = float(sum(100 + r for r in range(n)))
        for a, b, c in run_simulated(n, body):
            assert a == [expected_a] * 4 and b == [expected_b] * 4 and c == [float(n)] * 2


def test_bad_arguments_on_one_rank_stop_every_rank_at_once() -> None:
    """The bad rank raises its own error; the others raise a mismatch naming it, instead of
    waiting for a timeout; and the communicator stays in step afterwards."""

    def body(comm: Communicator) -> str:
        size = 11 if comm.rank == 1 else 12
        try:
            comm.reduce_scatter(torch.empty(4), torch.empty(size))
        except CollectiveMismatchError as exc:
            message = f"mismatch: {exc}"
        except ValueError as exc:
            message = f"own: {exc}"
        ones = torch.ones(3)
        comm.all_reduce(ones)
        assert ones.tolist() == [3.0] * 3
        return message

    messages = run_simulated(3, body, timeout=10)
    assert messages[1].startswith("own:") and "equal chunks" in messages[1]
    assert all(m.startswith("mismatch:") and "ranks [1]" in m for m in (messages[0], messages[2]))


def test_barrier_against_another_collective_is_a_mismatch() -> None:
    def body(comm: Communicator) -> str:
        try:
            if comm.rank == 0:
                comm.barrier()
            else:
                comm.broadcast(torch.ones(2), src=0)
        except CollectiveMismatchError as exc:
            return str(exc)
        return ""

    assert all("barrier" in m and "broadcast" in m for m in run_simulated(2, body))


def test_a_failure_releases_ranks_waiting_in_nested_subgroups() -> None:
    def body(comm: Communicator) -> None:
        inner = comm.split(0).split(0)
        if comm.rank == 0:
            raise ValueError("rank 0 fails")
        inner.barrier()

    start = time.monotonic()
    with pytest.raises(SimulatedRankError, match="rank 0 of 3 failed"):
        run_simulated(3, body, timeout=30)
    assert time.monotonic() - start < 10


@settings(max_examples=80, deadline=None)
@given(world_size=world_sizes, case=collective_cases())
def test_properties_hold_when_outputs_land_only_at_wait(
    world_size: int, case: CollectiveCase
) -> None:
    run_simulated(world_size, lambda comm: check_case(comm, case), defer_outputs=True)


def test_deferred_outputs_expose_a_missing_wait() -> None:
    """The harness that the engines' tests use must catch a forgotten wait()."""

    def body(comm: Communicator) -> list[float]:
        x = torch.ones(4)
        comm.all_reduce(x, async_op=True)  # no wait: deliberately wrong
        comm.barrier()
        return x.tolist()

    assert run_simulated(2, body, defer_outputs=True, deterministic=False) == [[1.0] * 4] * 2
    assert run_simulated(2, body, defer_outputs=False, deterministic=False) == [[2.0] * 4] * 2


def test_options_are_checked_once_and_every_subgroup_inherits_them() -> None:
    """One CommOptions travels from init to every split: deterministic, the consistency
    check (as changed at run time) and the timeout are the parent's."""
    from zero_comm import CommOptions

    with pytest.raises(ValueError, match="timeout must be a positive number"):
        CommOptions(timeout=0)
    with pytest.raises(ValueError, match="check_consistency"):
        CommOptions(check_consistency="sometimes")

    def body(comm: Communicator) -> list[CommOptions]:
        comm.check_consistency = "off"
        child = comm.split(comm.rank % 2)
        return [comm.options, child.options, child.split(0).options]

    results = run_simulated(4, body, deterministic=True, timeout=7.5)
    expected = CommOptions(deterministic=True, check_consistency="off", timeout=7.5)
    assert results == [[expected] * 3] * 4
