"""all_reduce_rows and reduce_scatter_rows: N physical ranks standing in for V virtual ones.

The spec: with ``deterministic=True`` the result is, bit for bit, the left fold of every
virtual rank's contribution in virtual-rank order, computed in one process, which is what
the V-rank all_reduce / reduce_scatter gives (checked against that too, on V simulated
ranks). Inputs span many magnitudes so that another order of additions rounds differently.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import CollectiveMismatchError, Communicator, ReduceOp, run_simulated
from zero_comm.simulated import SimulatedRankError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
}
OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MAX": ReduceOp.MAX, "MIN": ReduceOp.MIN}


def virtual_row(seed: int, virtual_rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Virtual rank ``virtual_rank``'s contribution: values over six decades."""
    gen = torch.Generator().manual_seed(seed * 1009 + virtual_rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)
    scale = 10.0 ** torch.randint(-3, 3, (numel,), generator=gen).double()
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * scale).to(dtype)


def fold(rows: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reference: one process, left fold in virtual-rank order."""
    if op is ReduceOp.MAX:
        return functools.reduce(torch.maximum, rows)
    if op is ReduceOp.MIN:
        return functools.reduce(torch.minimum, rows)
    total = functools.reduce(lambda a, b: a + b, rows)
    return total / len(rows) if op is ReduceOp.AVG else total


def rows_of(counts: tuple[int, ...], rank: int, seed: int, numel: int, dtype: torch.dtype):
    first = sum(counts[:rank])
    return torch.stack(
        [virtual_row(seed, v, numel, dtype) for v in range(first, first + counts[rank])]
    )


cases = st.fixed_dictionaries(
    {
        "counts": st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple),
        "chunk": st.integers(0, 9),
        "dtype": st.sampled_from(sorted(DTYPES)),
        "op": st.sampled_from(sorted(OPS)),
        "seed": st.integers(0, 2**16),
        "async_op": st.booleans(),
        "as_list": st.booleans(),
    }
).filter(lambda c: not (c["op"] == "AVG" and c["dtype"] == "int64"))


def _run(case: dict, collective: str, deterministic: bool) -> None:
    counts, chunk, seed = case["counts"], case["chunk"], case["seed"]
    dtype, op, size = DTYPES[case["dtype"]], OPS[case["op"]], len(case["counts"])
    n = chunk * size if collective == "reduce_scatter_rows" else chunk * size + (seed % 3)
    every = [virtual_row(seed, v, n, dtype) for v in range(sum(counts))]
    expected = fold(every, op) if every else None

    def body(comm: Communicator) -> torch.Tensor:
        rows = rows_of(counts, comm.rank, seed, n, dtype)
        given = list(rows.clone()) if case["as_list"] else rows  # a list of rows, or (c, n)
        if collective == "reduce_scatter_rows":
            out = torch.full((chunk,), 7, dtype=dtype)
            handle = comm.reduce_scatter_rows(
                out, given, counts, op, async_op=case["async_op"], label="g"
            )
        else:
            out = torch.full((n,), 7, dtype=dtype)
            handle = comm.all_reduce_rows(out, given, counts, op, async_op=case["async_op"])
        if handle is not None:
            handle.wait()
        return out

    results = run_simulated(size, body, deterministic=deterministic, defer_outputs=True)
    assert expected is not None
    for rank, got in enumerate(results):
        want = (
            expected[rank * chunk : (rank + 1) * chunk]
            if collective.startswith("reduce")
            else expected
        )
        exact = deterministic or op in (ReduceOp.MAX, ReduceOp.MIN) or not dtype.is_floating_point
        if exact:
            assert torch.equal(got, want), (rank, got, want)
        else:
            tolerance = {torch.bfloat16: 0.1, torch.float16: 0.02}.get(dtype, 1e-4)
            assert torch.allclose(got.double(), want.double(), rtol=tolerance, atol=tolerance * 1e3)


@settings(max_examples=150, deadline=None)
@given(case=cases, collective=st.sampled_from(["all_reduce_rows", "reduce_scatter_rows"]))
def test_deterministic_rows_equal_the_virtual_rank_fold_bit_for_bit(
    case: dict, collective: str
) -> None:
    _run(case, collective, deterministic=True)


@settings(max_examples=60, deadline=None)
@given(case=cases, collective=st.sampled_from(["all_reduce_rows", "reduce_scatter_rows"]))
def test_native_rows_equal_the_fold_within_rounding(case: dict, collective: str) -> None:
    _run(case, collective, deterministic=False)


@pytest.mark.parametrize("counts", [(2, 1), (1, 2), (1, 1, 2), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_the_collective_of_v_simulated_ranks(
    counts: tuple[int, ...], dtype: torch.dtype
) -> None:
    """The same bits as the plain collectives run on a world of V = sum(counts) ranks."""
    size, total, chunk = len(counts), sum(counts), 5
    n = chunk * size

    def virtual_world(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        mine = virtual_row(3, comm.rank, n, dtype)
        reduced = mine.clone()
        comm.all_reduce(reduced)
        # the V-rank reduce_scatter of the same rows, re-chunked onto the N physical ranks
        return reduced, mine

    v_results = run_simulated(total, virtual_world)
    reference = v_results[0][0]

    def physical(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = rows_of(counts, comm.rank, 3, n, dtype)
        whole, part = torch.empty(n, dtype=dtype), torch.empty(chunk, dtype=dtype)
        comm.all_reduce_rows(whole, rows, counts)
        comm.reduce_scatter_rows(part, rows, counts)
        return whole, part

    for rank, (whole, part) in enumerate(run_simulated(size, physical)):
        assert torch.equal(whole, reference)
        assert torch.equal(part, reference[rank * chunk : (rank + 1) * chunk])


def test_mismatched_row_counts_are_named_on_every_rank() -> None:
    def body(comm: Communicator) -> None:
        counts = (2, 1) if comm.rank == 0 else (1, 2)
        rows = torch.ones(counts[comm.rank], 4)
        comm.all_reduce_rows(torch.empty(4), rows, counts, label="grads")

    with pytest.raises(SimulatedRankError) as caught:
        run_simulated(2, body)
    assert isinstance(caught.value.__cause__, CollectiveMismatchError)
    assert "all_reduce_rows" in str(caught.value.__cause__)
    assert "row_counts#" in str(caught.value.__cause__)


def test_rows_of_the_wrong_shape_name_the_fix() -> None:
    def body(comm: Communicator) -> None:
        comm.reduce_scatter_rows(torch.empty(3), torch.ones(1, 6), (2, 1))

    with pytest.raises(SimulatedRankError) as caught:
        run_simulated(2, body)
    assert "row_counts[0]=2 rows" in str(caught.value)


@pytest.mark.parametrize("bad", [(2,), (2, 0), (2, 1.5)])
def test_bad_row_counts_are_refused(bad: tuple) -> None:
    def body(comm: Communicator) -> None:
        comm.all_reduce_rows(torch.empty(4), torch.ones(1, 4), bad)

    with pytest.raises(SimulatedRankError, match="one int >= 1 per rank"):
        run_simulated(2, body)


def test_stats_count_the_rows_moved() -> None:
    """Ordered: every rank sends max(counts) rows (padding included); native: one row."""
    counts, n = (3, 1), 8

    def body(comm: Communicator) -> dict:
        rows = torch.ones(counts[comm.rank], n)
        comm.reduce_scatter_rows(torch.empty(n // 2), rows, counts)
        comm.all_reduce_rows(torch.empty(n), rows, counts)
        return {
            k: comm.stats[k].volume_bytes for k in ("reduce_scatter", "all_gather", "all_reduce")
        }

    ordered = run_simulated(2, body, deterministic=True)[0]
    # reduce_scatter_rows: 3 rows of 8; all_reduce_rows: 3 rows of 8, then a gather of 8
    assert ordered["reduce_scatter"] == 2 * Fraction(1, 2) * 3 * n * 4
    assert ordered["all_gather"] == Fraction(1, 2) * n * 4
    native = run_simulated(2, body, deterministic=False)[0]
    assert native["reduce_scatter"] == Fraction(1, 2) * n * 4
    assert native["all_reduce"] == 2 * Fraction(1, 2) * n * 4
