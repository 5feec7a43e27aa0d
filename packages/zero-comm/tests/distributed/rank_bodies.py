"""Test bodies that run on every rank of a real world (see zero_comm.testing.harness).

They live apart from the test module so each rank imports only what it runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from zero_comm import CollectiveMismatchError, CommTimeoutError, Communicator
from zero_comm.testing.properties import (
    CollectiveCase,
    check_case,
    check_mismatch_is_named,
    run_collective_properties,
)


def collective_properties(comm: Communicator, examples: int) -> int:
    """The hypothesis suite of the simulated tests, on real ranks, all in step."""
    ran = run_collective_properties(comm, examples)
    check_mismatch_is_named(comm)
    return ran


def mesh_subgroups(comm: Communicator, tp: int) -> list[int]:
    """Rows (tensor parallel) and columns (data parallel) of a tp x dp mesh."""
    row = comm.split(color=comm.rank // tp)
    column = comm.split(color=comm.rank % tp)
    for group in (row, column, comm):
        for seed, dtype in enumerate(("float32", "bfloat16", "float16")):
            check_case(group, CollectiveCase("all_reduce", 101, dtype, seed=seed))
            check_case(group, CollectiveCase("reduce_scatter", 13, dtype, "AVG", seed=seed))
            check_case(group, CollectiveCase("all_gather", 7, dtype, seed=seed))
            check_case(group, CollectiveCase("all_gather", 70001, dtype, seed=seed))  # > 256 KiB
    return [row.rank, row.world_size, column.rank, column.world_size]


def rank_one_dies(comm: Communicator, collective: str = "all_reduce") -> None:
    """Rank 1 exits abruptly before a collective the others enter (an all-reduce, or an
    all-gather large enough that gloo runs it as broadcasts)."""
    if comm.rank == 1:
        os._exit(3)
    if collective == "all_gather":
        comm.all_gather(torch.empty(comm.world_size << 17), torch.ones(1 << 17))
    else:
        comm.all_reduce(torch.ones(1000))


def rank_one_is_late(comm: Communicator, late_s: float) -> float:
    """Rank 0 enters a collective that rank 1 reaches only after rank 0's timeout."""
    if comm.rank == 1:
        time.sleep(late_s)
        return 0.0
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
    except CommTimeoutError as exc:
        elapsed = time.monotonic() - start
        raise CommTimeoutError(
            f"rank 0 timed out after {elapsed:.1f}s as it should: {exc}"
        ) from None
    raise AssertionError("rank 0's all_reduce returned although rank 1 never came")


def fails_on_last_rank(comm: Communicator) -> None:
    comm.all_reduce(torch.ones(3))
    assert comm.rank != comm.world_size - 1, "deliberate failure on the last rank"


def stats_of_one_step(comm: Communicator, numel: int) -> dict[str, float]:
    """One all_reduce, reduce_scatter and all_gather of ``numel`` elements per rank."""
    comm.stats.reset()
    flat = torch.ones(numel * comm.world_size)
    comm.all_reduce(flat)
    shard = torch.empty(numel)
    comm.reduce_scatter(shard, flat)
    comm.all_gather(flat, shard)
    return {name: float(c["volume_elements"]) for name, c in comm.stats.as_dict().items()}


def barriers_in_every_form(comm: Communicator) -> int:
    comm.barrier()
    handle = comm.barrier(async_op=True)
    handle.wait()
    return comm.stats["barrier"].calls


def waits_in_any_order(comm: Communicator) -> list[float]:
    """Two async deterministic all-reduces, waited in opposite orders on odd/even ranks."""
    a = torch.full((5,), 1.0 + comm.rank)
    b = torch.full((5,), 100.0 + comm.rank)
    first, second = comm.all_reduce(a, async_op=True), comm.all_reduce(b, async_op=True)
    assert first is not None and second is not None
    for handle in (second, first) if comm.rank % 2 else (first, second):
        handle.wait()
    return [a[0].item(), b[0].item()]


def dropped_inputs_arrive(comm: Communicator) -> bool:
    """Async all-to-all and all-gather whose 6-8 MB inputs the caller drops before the wait,
    reusing their memory at once: the data must still be what was sent. MPI's buffers are
    raw addresses; before its requests kept their tensors, this read freed memory (qgZ
    dropped its encoded send buffer so)."""
    numel = comm.world_size << 19  # all_to_all: N equal chunks
    ok = True
    for name in ("all_to_all", "all_gather"):
        out = torch.empty(numel * (comm.world_size if name == "all_gather" else 1))
        inp = torch.full((numel,), float(comm.rank + 1))
        handle = getattr(comm, name)(out, inp, async_op=True)
        del inp
        junk = torch.full((numel,), -1.0)  # likely the freed block, overwritten
        handle.wait()
        chunks = out.view(comm.world_size, -1)
        ok &= all(bool((chunks[r] == r + 1).all()) for r in range(comm.world_size))
        del junk
    return ok


def barriers_waits_and_stats(comm: Communicator, numel: int) -> dict[str, Any]:
    """barriers_in_every_form, waits_in_any_order, stats_of_one_step, then
    dropped_inputs_arrive, in one start of the ranks (each start costs seconds of the
    default run)."""
    return {
        "barriers": barriers_in_every_form(comm),
        "waits": waits_in_any_order(comm),
        "volume": stats_of_one_step(comm, numel),
        "dropped_inputs_arrive": dropped_inputs_arrive(comm),
    }


def splits_of_splits(comm: Communicator) -> list[float]:
    """Split a subgroup (only its members take part), then split the world again."""
    rank = comm.rank
    pairs = comm.split(color=rank // 2)
    alone = pairs.split(color=pairs.rank)
    one = torch.ones(1)
    alone.all_reduce(one)
    interleaved = comm.split(color=rank % 2)
    mine = torch.full((1,), float(rank))
    interleaved.all_reduce(mine)
    reversed_ = comm.split(color=0, key=-rank)
    tie = reversed_.split(color=0, key=0)  # ties keep the parent's order, as MPI does
    for group in (tie, reversed_, interleaved, alone, pairs):
        group.close()
    return [one.item(), mine.item(), float(tie.rank), float(reversed_.rank)]


def diverges_after_warm_up(comm: Communicator, mode: str) -> dict[str, object]:
    """Six steps of three collectives; at step 5 rank 1 all-gathers another label. The
    calls compared per step, the error's message and how long it took to come.

    On a communicator of its own: with "digest" the ranks that went ahead still have their
    all-gather in flight, so the communicator is unusable after (the harness needs its)."""
    comm = comm.split(color=0)
    comm.check_consistency = mode
    compared = []
    for step in range(6):
        before = comm.compared_calls
        label = "layer 1" if step == 5 and comm.rank == 1 else "layer 0"
        started = time.monotonic()
        try:
            comm.all_reduce(torch.ones(64), label="norm")
            comm.all_gather(torch.empty(16 * comm.world_size), torch.ones(16), label=label)
            comm.reduce_scatter(torch.empty(8), torch.ones(8 * comm.world_size), label="grads")
        except CollectiveMismatchError as exc:
            return {
                "compared": compared,
                "message": str(exc),
                "after_s": time.monotonic() - started,
            }
        compared.append(comm.compared_calls - before)
    return {"compared": compared, "message": "", "after_s": 0.0}


def thread_count(comm: Communicator) -> dict[str, object]:
    """What this rank computes with: torch's intra-op threads and the variables children get."""
    return {
        "torch": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
    }


def change_thread_count(comm: Communicator) -> None:
    """A body that computes with another thread count than the harness gave it."""
    torch.set_num_threads(torch.get_num_threads() + 1)


def row_collectives_equal_the_fold(comm: Communicator, counts: list[int]) -> int:
    """all_reduce_rows / reduce_scatter_rows (float32, bfloat16; sync and async) equal, bit
    for bit, the left fold of the sum(counts) virtual ranks' rows done here in one process.
    Returns how many cases were checked."""
    import functools

    from zero_comm import ReduceOp

    size, chunk = comm.world_size, 5
    n = size * chunk
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        every = []
        for v in range(sum(counts)):
            gen = torch.Generator().manual_seed(11 + v)
            scale = 10.0 ** torch.randint(-3, 3, (n,), generator=gen).double()
            every.append((torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype))
        first = sum(counts[: comm.rank])
        rows = torch.stack(every[first : first + counts[comm.rank]])
        expected = functools.reduce(lambda a, b: a + b, every)
        for async_op in (False, True):
            whole, part = torch.empty(n, dtype=dtype), torch.empty(chunk, dtype=dtype)
            h1 = comm.all_reduce_rows(whole, rows, counts, ReduceOp.SUM, async_op=async_op)
            h2 = comm.reduce_scatter_rows(part, rows, counts, ReduceOp.SUM, async_op=async_op)
            for handle in (h2, h1):  # waited out of order: the gather phase keeps its place
                if handle is not None:
                    handle.wait()
            if comm.deterministic:
                assert torch.equal(whole, expected), (dtype, whole, expected)
                mine = expected[comm.rank * chunk : (comm.rank + 1) * chunk]
                assert torch.equal(part, mine), (dtype, part, mine)
            else:
                tol = 0.1 if dtype is torch.bfloat16 else 1e-4
                assert torch.allclose(whole.double(), expected.double(), rtol=tol, atol=tol * 1e3)
            checked += 1
    return checked
