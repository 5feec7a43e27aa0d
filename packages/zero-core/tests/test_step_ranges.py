"""A stage-3 step under ``torch.profiler`` shows the engine's phases as ``zero::`` ranges
(zero_comm.profiler_ranges): the unit gathers and frees, the collectives and their waits,
the optimizer step, and with offload to disk the swap reads and writes.

Two simulated ranks (threads), so the profiler records every thread
(``profile_all_threads``): the ranks' and the swap pipeline's I/O threads. Only ranges
that lie within a step (the test's own ``test::step`` range) count, so ranges the build
emits do not make a step's missing one pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parity import ParityCase, build_engine, normalised
from test_checkpoint import run_steps
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from zero_comm import Communicator, run_simulated

CASE = normalised(
    ParityCase(widths=(5, 130, 7), vocab=11, tie=True, bucket_numel=300, persistence_threshold=0)
)
STEP = "test::step"
# What every stage-3 step does: gather units (prefetched along the first step's record),
# free them, reduce-scatter the gradients, step the optimizer over the master tiles.
STAGE3 = {
    "zero::gather_unit", "zero::gather_unit.wait", "zero::free_unit",
    "zero::all_gather", "zero::all_gather.wait",
    "zero::reduce_scatter", "zero::reduce_scatter.wait",
    "zero::optimizer_step", "zero::publish",
}  # fmt: skip
SWAP = {"zero::swap.read", "zero::swap.write", "zero::swap.read.wait"}


def ranges_within_steps(case: ParityCase, settings: dict[str, Any]) -> set[str]:
    """The ``zero::`` range names recorded during the second step of two on 2 ranks."""

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3, settings)
        run_steps(engine, case, comm, 0, 1)  # the first pass records the gather order
        with record_function(STEP):
            run_steps(engine, case, comm, 1, 1)
        engine.close()

    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        run_simulated(2, body)
    events = [e for e in prof.events() if e.name.startswith(("zero::", STEP))]
    steps = [e.time_range for e in events if e.name == STEP]
    assert len(steps) == 2, "each rank's step was recorded"
    return {
        e.name
        for e in events
        if e.name != STEP
        and any(s.start <= e.time_range.start and e.time_range.end <= s.end for s in steps)
    }


def test_a_stage3_step_names_its_gathers_reductions_waits_and_optimizer_step() -> None:
    names = ranges_within_steps(CASE, {})
    assert names >= STAGE3, f"missing: {sorted(STAGE3 - names)}"
    assert not names & SWAP, "nothing is swapped without offload"


def test_offload_to_disk_names_the_swap_reads_and_writes(tmp_path: Path) -> None:
    settings = {"offload_optimizer": "disk", "offload_params": "disk",
                "offload_sub_group_numel": 64, "offload_dir": str(tmp_path)}  # fmt: skip
    names = ranges_within_steps(CASE, settings)
    assert names >= STAGE3 | SWAP, f"missing: {sorted((STAGE3 | SWAP) - names)}"


def test_a_checkpoint_save_and_load_are_ranges(tmp_path: Path) -> None:
    case = normalised(ParityCase(widths=(8, 16, 4), persistence_threshold=0))

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3, {})
        run_steps(engine, case, comm, 0, 1)
        engine.save(tmp_path)
        engine.load(tmp_path)

    config = _ExperimentalConfig(profile_all_threads=True)  # simulated ranks are threads
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        run_simulated(2, body)
    names = {e.name for e in prof.events()}
    assert {"zero::checkpoint.save", "zero::checkpoint.load"} <= names
