"""Run as a process that a test kills: trains and saves a checkpoint after every step.

    python checkpoint_saver.py FOLDER

Two simulated ranks, stage 3, a model of about 2.2M parameters, so that a large part of
each loop is spent saving. Each save records the number of steps in ``extra``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from parity import ParityCase, build_engine, normalised

from zero_comm import Communicator, run_simulated
from zero_comm.testing.threads import pin_test_threads

CASE = normalised(ParityCase(widths=(64, 1024, 1024, 64), optimizer="adam",
                             persistence_threshold=0, bucket_numel=1 << 18))  # fmt: skip


def train_and_save(comm: Communicator, folder: Path | None, steps: int) -> dict[str, torch.Tensor]:
    from test_checkpoint import run_steps

    engine = build_engine(CASE, comm, 3)
    for step in range(steps):
        run_steps(engine, CASE, comm, step, 1)
        if folder is not None:
            engine.save(folder.parent, extra={"steps": step + 1}, tag=folder.name)
    return engine.full_state_dict()


if __name__ == "__main__":
    pin_test_threads()  # the test compares with its own run: the same thread count
    target = Path(sys.argv[1])
    run_simulated(2, lambda comm: train_and_save(comm, target, 10_000))
