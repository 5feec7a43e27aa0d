"""Every collective is a ``zero::<collective>`` range on a torch.profiler trace and its
wait a ``zero::<collective>.wait`` range (the communicator is the one place every
collective passes); nothing is recorded, and no string built, when no profiler runs.
The logger ``zero_comm`` is silent by default and says at DEBUG what it creates."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from zero_comm import Communicator, ReduceOp, run_simulated
from zero_comm.profiler_ranges import profiler_range, profiling


def collectives(comm: Communicator) -> None:
    """One of each collective: asynchronous ones waited for by hand, synchronous ones."""
    n = comm.world_size
    full, shard = torch.zeros(2 * n), torch.ones(2)
    comm.all_gather(full, shard, async_op=True).wait()
    comm.reduce_scatter(shard, torch.ones(2 * n), async_op=True).wait()
    comm.all_reduce(torch.ones(3), ReduceOp.AVG)
    comm.all_to_all(torch.zeros(n), torch.ones(n))
    comm.broadcast(torch.ones(2), 0)
    comm.barrier()
    comm.all_gather_object(comm.rank)


def recorded_ranges(deterministic: bool) -> list[torch.autograd.profiler_util.FunctionEvent]:
    config = _ExperimentalConfig(profile_all_threads=True)  # the ranks are threads
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        run_simulated(2, collectives, deterministic=deterministic)
    return [e for e in prof.events() if e.name.startswith("zero::")]


@pytest.mark.parametrize("deterministic", [True, False])
def test_each_collective_and_its_wait_is_a_named_range(deterministic: bool) -> None:
    events = recorded_ranges(deterministic)
    names = {e.name for e in events}
    for collective in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        assert f"zero::{collective}" in names, collective
        assert f"zero::{collective}.wait" in names, collective
    assert {"zero::barrier", "zero::all_gather_object"} <= names
    # Both ranks: one launch range of each collective per rank (split may add its own).
    launches = [e for e in events if e.name == "zero::reduce_scatter"]
    assert len(launches) == 2 and len({e.thread for e in launches}) == 2
    # A synchronous collective's wait lies inside its launch, on the same thread.
    for wait in (e for e in events if e.name == "zero::all_reduce.wait"):
        inside = wait.time_range
        assert any(
            e.name == "zero::all_reduce"
            and e.thread == wait.thread
            and e.time_range.start <= inside.start <= inside.end <= e.time_range.end
            for e in events
        )


def test_without_a_profiler_a_range_is_one_shared_no_op() -> None:
    assert not profiling()
    assert profiler_range("all_gather") is profiler_range("gather_unit", ".wait")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert profiling()
        with profiler_range("all_gather", ".wait") as inside:
            assert inside is not None  # record_function's handle: a real range
    assert not profiling()
    assert "zero::all_gather.wait" in {e.name for e in prof.events()}


def test_the_logger_is_silent_by_default_and_names_each_communicator_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("zero_comm")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    with caplog.at_level(logging.DEBUG, logger="zero_comm"):
        run_simulated(2, lambda comm: None, deterministic=True)
    created = [r for r in caplog.records if "communicator created" in r.getMessage()]
    assert {r.name for r in created} == {"zero_comm.communicator"}
    messages = sorted(r.getMessage() for r in created)
    assert len(messages) == 2
    for rank, message in enumerate(messages):
        assert f"backend simulated, rank {rank} of 2" in message
        assert "deterministic True" in message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_comm"):
        run_simulated(2, lambda comm: None)
    assert not [r for r in caplog.records if "communicator created" in r.getMessage()]
