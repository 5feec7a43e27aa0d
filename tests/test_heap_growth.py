"""A stage-3 step does not leave its heap to grow around holes: zero_comm keeps torch's
flight recorder off (zero_comm/flight_recorder.py), whose per-collective entries, alive
until its ring wraps, sat between freed activations so that the next step's activations
of the same size no longer fit there. Found in the largest-model search with every block
checkpointed: ours-3's heap grew 35-40 MiB a step (docs/stage3-memory.md).

The control sets the recorder's size as a user may, which zero_comm keeps: the same run
then grows, so the test measures the recorder and not glibc's luck.

Limits: with the recorder off the free heap moved by about 3 MiB from the second step to
the eighth (glibc's bins settling), with it on by about 70 MiB (2026-12-05, torch 2.13).
8 MiB leaves room for the first; the control must exceed 3x that limit. If the control
stops growing (a torch whose recorder no longer holds heap blocks, or a communicator that
is not split: on the world group it grew 10 MiB against 6), this test no longer guards
anything: find what grows the heap again with tools/malloc_trace/ before changing it.

12 steps, not 8. Stage 3 now keeps backward's first units gathered from forward
(param_gatherer), so it gathers less (likely fewer recorder entries); over 6 measured steps the
control grew only 23.8 MiB once in CI (the bound is 24). Over 10 it grew 62.0 MiB, the
default 4.8 (2026-12-06).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_comm.flight_recorder import RECORDER_SIZE_VARIABLES
from zero_core.host_heap import heap_bytes

RANK = Path(__file__).with_name("heap_growth_rank.py")
STEPS = 12
SETTLED = 2  # steps before the growth is measured: the first ones size the heap


def free_heap_growth_mib(recorder_size: str | None) -> float:
    """Free heap MiB after the last step minus after step SETTLED, on rank 0 of 2."""
    env = {k: v for k, v in os.environ.items() if k not in RECORDER_SIZE_VARIABLES}
    env.update(MALLOC_MMAP_THRESHOLD_=str(1 << 20), MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    env.pop("LD_PRELOAD", None)
    env.pop("GLIBC_TUNABLES", None)
    if recorder_size is not None:
        env["TORCH_FR_BUFFER_SIZE"] = recorder_size
    done = subprocess.run(
        [sys.executable, "-m", "zero_comm.launch", "-n", "2", sys.executable, str(RANK),
         str(STEPS)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("FREE-MIB "))
    free = json.loads(line.split(" ", 1)[1])
    return float(free[-1] - free[SETTLED - 1])


@pytest.mark.gloo
@pytest.mark.timeout(600)
@pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")
def test_stage3_steps_with_checkpointing_keep_the_heap_flat() -> None:
    growth = free_heap_growth_mib(None)
    control = free_heap_growth_mib("2000")
    assert growth < 8.0, f"the heap grew {growth:.1f} MiB over {STEPS - SETTLED} steps"
    assert control > 3 * max(growth, 8.0), (
        f"the control (recorder on) grew {control:.1f} MiB, the default {growth:.1f}: the test "
        "no longer sees the effect it guards against; see this module's docstring"
    )
