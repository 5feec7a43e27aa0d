"""Bodies run on every rank of a real world: the stage parity suite over gloo and MPI."""

from __future__ import annotations

import sys
from pathlib import Path

from zero_comm import Communicator
from zero_comm.testing.properties import run_property_in_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # parity.py lives one level up
from parity import parity_cases, stages_equal_stage0


def parity_suite(comm: Communicator, examples: int) -> int:
    """The stage parity property on real ranks: every rank draws the same cases."""
    return run_property_in_step(
        comm, parity_cases(), lambda case: stages_equal_stage0(comm, case), examples
    )
