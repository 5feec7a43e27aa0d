"""The collective properties, written once, run on simulated and on real ranks.

A :class:`CollectiveCase` says which collective to call on what data. Every rank can build
every rank's input from the case's seed (:func:`rank_input`), so each rank computes the
expected result itself, in one process, and compares:

    all_reduce SUM   the left fold x_0 + x_1 + ... in the dtype; bit-exact when the
                     communicator is deterministic or the dtype is an integer, else within
                     the rounding of N additions
    all_reduce AVG   that fold divided by N
    MAX, MIN         exact on every backend
    reduce_scatter   chunk r of the all_reduce result, and bit-equal to the communicator's
                     own all_reduce when deterministic
    all_gather       the concatenation in rank order, exact
    broadcast        the root's input, exact

The same cases run under hypothesis in a simulated world (hundreds of examples) and inside
real ranks (:func:`run_collective_properties`), where every rank draws the same examples
and all ranks agree on each example's outcome.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zero_comm.call_check import SUPPORTED_DTYPES
from zero_comm.communicator import Communicator
from zero_comm.errors import CollectiveMismatchError
from zero_comm.reduce_op import ReduceOp

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES}
_INT_RANGE = {torch.int8: (-30, 31), torch.uint8: (0, 60)}


@dataclass(frozen=True)
class CollectiveCase:
    """One call. ``numel`` is per rank: the all_reduce/broadcast tensor, the reduce_scatter
    output, the all_gather input."""

    collective: str
    numel: int
    dtype: str
    op: str = "SUM"
    src: int = 0
    seed: int = 0
    async_op: bool = False


def rank_input(case: CollectiveCase, rank: int, world_size: int) -> torch.Tensor:
    """What ``rank`` contributes to ``case``, the same on whichever process builds it."""
    dtype = DTYPES[case.dtype]
    numel = case.numel * world_size if case.collective == "reduce_scatter" else case.numel
    generator = torch.Generator().manual_seed(case.seed * 4099 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=generator, dtype=torch.float64) * 3).to(dtype)
    low, high = _INT_RANGE.get(dtype, (-1000, 1001))
    return torch.randint(low, high, (numel,), generator=generator, dtype=torch.int64).to(dtype)


def rank_order_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reference: a left fold in the inputs' dtype, written independently of zero_comm."""
    if op in ("SUM", "AVG"):
        total = functools.reduce(operator.add, inputs)
        return total / len(inputs) if op == "AVG" else total
    pick = torch.maximum if op == "MAX" else torch.minimum
    return functools.reduce(pick, inputs)


def _close(actual: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Within the rounding of len(inputs) additions, each rounded to the dtype."""
    eps = torch.finfo(actual.dtype).eps
    bound = len(inputs) * eps * (sum(x.double().abs() for x in inputs) + 1)
    return bool(((actual.double() - expected.double()).abs() <= bound).all())


def check_case(comm: Communicator, case: CollectiveCase) -> None:
    """Run ``case`` on ``comm`` and assert the result; collectives first, asserts after."""
    size, rank = comm.world_size, comm.rank
    inputs = [rank_input(case, r, size) for r in range(size)]
    mine = inputs[rank].clone()
    op = ReduceOp[case.op]
    dtype = DTYPES[case.dtype]
    exact = comm.deterministic or not dtype.is_floating_point or case.op in ("MAX", "MIN")
    full_ref = rank_order_reduce(inputs, case.op) if case.op else None

    if case.collective == "all_reduce":
        handle = comm.all_reduce(mine, op, async_op=case.async_op)
        if handle is not None:
            handle.wait()
        assert full_ref is not None
        ok = torch.equal(mine, full_ref) if exact else _close(mine, full_ref, inputs)
        assert ok, f"all_reduce {case}: got {mine[:8]} expected {full_ref[:8]}"
    elif case.collective == "reduce_scatter":
        out = torch.empty(case.numel, dtype=dtype)
        handle = comm.reduce_scatter(out, mine, op, async_op=case.async_op)
        if handle is not None:
            handle.wait()
        whole = inputs[rank].clone()
        comm.all_reduce(whole, op)
        assert full_ref is not None
        lo, hi = rank * case.numel, (rank + 1) * case.numel
        expected = full_ref[lo:hi]
        ok = (
            torch.equal(out, expected)
            if exact
            else _close(out, expected, [x[lo:hi] for x in inputs])
        )
        assert ok, f"reduce_scatter {case}: got {out[:8]} expected {expected[:8]}"
        if comm.deterministic:
            assert torch.equal(out, whole[lo:hi]), f"reduce_scatter {case} != all_reduce slice"
    elif case.collective == "all_gather":
        out = torch.empty(case.numel * size, dtype=dtype)
        handle = comm.all_gather(out, mine, async_op=case.async_op)
        if handle is not None:
            handle.wait()
        assert torch.equal(out, torch.cat(inputs)), f"all_gather {case}"
    elif case.collective == "broadcast":
        src = case.src % size
        handle = comm.broadcast(mine, src, async_op=case.async_op)
        if handle is not None:
            handle.wait()
        assert torch.equal(mine, inputs[src]), f"broadcast {case}"
    else:
        raise ValueError(f"unknown collective {case.collective!r}")


# Over 256 KiB per rank in every dtype: gloo's all-gather then runs as one broadcast per
# rank (torch_backend.GLOO_GATHER_BY_BROADCAST_BYTES), a path of its own.
LARGE_NUMEL = 131075


def collective_cases() -> Any:
    """A hypothesis strategy of :class:`CollectiveCase` (hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    sizes = st.one_of(
        st.sampled_from([0, 1, 2, 3, 5, 7, 11, 13, 97, 1031, LARGE_NUMEL]), st.integers(0, 400)
    )

    @st.composite
    def cases(draw: Any) -> CollectiveCase:
        collective = draw(st.sampled_from(COLLECTIVES))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        ops = ["SUM", "MAX", "MIN"] + (["AVG"] if DTYPES[dtype].is_floating_point else [])
        reduces = collective in ("all_reduce", "reduce_scatter")
        return CollectiveCase(
            collective=collective,
            numel=draw(sizes),
            dtype=dtype,
            op=draw(st.sampled_from(ops)) if reduces else "SUM",
            src=draw(st.integers(0, 3)),
            seed=draw(st.integers(0, 2**20)),
            async_op=draw(st.booleans()),
        )

    return cases()


def check_mismatch_is_named(comm: Communicator) -> None:
    """Ranks that disagree on numel or dtype all raise, naming the ranks; the comm survives."""
    if comm.world_size == 1:
        return
    wrong_numel = torch.ones(5 + (comm.rank == comm.world_size - 1))
    wrong_dtype = torch.ones(4, dtype=torch.float16 if comm.rank == 0 else torch.float32)
    for tensor in (wrong_numel, wrong_dtype):
        try:
            comm.all_reduce(tensor)
        except CollectiveMismatchError as exc:
            assert f"[rank {comm.rank}]" in str(exc), str(exc)
            assert "rank 0:" in str(exc) and f"rank {comm.world_size - 1}:" in str(exc)
        else:
            raise AssertionError(f"rank {comm.rank}: a mismatched all_reduce did not raise")
    ones = torch.ones(3)
    comm.all_reduce(ones)
    assert torch.equal(ones, torch.full((3,), float(comm.world_size))), "comm unusable after"


def agree(comm: Communicator, error: str) -> None:
    """Raise on every rank if ``error`` is non-empty on any rank."""
    everyone = comm.all_gather_object(error)
    failed = {r: e for r, e in enumerate(everyone) if e}
    if failed:
        raise AssertionError("; ".join(f"rank {r}: {e}" for r, e in failed.items()))


def run_property_in_step(
    comm: Communicator, strategy: Any, check: Callable[[Any], None], max_examples: int
) -> int:
    """Hypothesis over ``strategy`` on real ranks, all in step; returns the examples run.

    Every rank draws the same examples (derandomized, no database, no health checks that
    depend on timing), checks that rank 0 drew the same one, and all ranks agree on each
    example's outcome (``check`` raising AssertionError on any rank fails it on all), so
    failures and shrinking stay in step across ranks.
    """
    from hypothesis import HealthCheck, given, settings

    count = 0

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def prop(example: Any) -> None:
        nonlocal count
        count += 1
        differs = comm.broadcast_object(example, 0) != example
        agree(comm, f"drew {example}, which differs from rank 0's example" if differs else "")
        error = ""
        try:
            check(example)
        except AssertionError as exc:
            error = str(exc)
        agree(comm, error)

    prop()
    return count


def run_collective_properties(comm: Communicator, max_examples: int = 60) -> int:
    """:func:`check_case` over :func:`collective_cases` on real ranks, all in step; then,
    whatever was drawn, an all-gather over 256 KiB per rank in every dtype, blocking and
    asynchronous (gloo runs those as broadcasts, a path of their own)."""
    ran = run_property_in_step(
        comm, collective_cases(), lambda case: check_case(comm, case), max_examples
    )
    for seed, dtype in enumerate(sorted(DTYPES)):
        for async_op in (False, True):
            check_case(
                comm, CollectiveCase("all_gather", LARGE_NUMEL, dtype, seed=seed, async_op=async_op)
            )
    return ran
