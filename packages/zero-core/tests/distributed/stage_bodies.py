"""Bodies run on every rank of a real world: the stage parity suite over gloo and MPI."""

from __future__ import annotations

import sys
from pathlib import Path

from zero_comm import Communicator
from zero_comm.testing.properties import agree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # parity.py lives one level up
from parity import ParityCase, parity_cases, stages_equal_stage0


def parity_suite(comm: Communicator, examples: int) -> int:
    """Hypothesis-drawn cases, identical on every rank; all ranks agree on each outcome."""
    from hypothesis import HealthCheck, given, settings

    ran = 0

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(parity_cases())
    def prop(case: ParityCase) -> None:
        nonlocal ran
        ran += 1
        differs = comm.broadcast_object(case, 0) != case
        agree(comm, f"drew {case}, not rank 0's case" if differs else "")
        error = ""
        try:
            stages_equal_stage0(comm, case)
        except AssertionError as exc:
            error = str(exc)
        agree(comm, error)

    prop()
    return ran
