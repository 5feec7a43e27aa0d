"""Virtual-rank runs for the parity tests: N ranks with micro_batches_per_rank = counts
against the homogeneous run at V = sum(counts) ranks (parity.py's harness).

Virtual rank v's micro-batch m of step s is parity.micro_batch's global index
(s * accumulation + m) * V + v, which is what rank v of the V-rank run trains on, so
the two runs see the same data and must hold the same bits after every step.
"""

from __future__ import annotations

from typing import Any

import torch
from parity import DTYPES, ParityCase, build_engine, loss_of, micro_batch, normalised, train

import zero_core
from zero_comm import Communicator, run_simulated


def run_virtual_steps(
    engine: zero_core.ZeroEngine, case: ParityCase, comm: Communicator, steps: range
) -> list[dict[str, torch.Tensor]]:
    """parity.run_steps for an engine with virtual ranks: c_i backward calls per micro-step,
    slot s being virtual rank o_i + s; step() after every backward (it applies once per
    accumulation * c_i calls)."""
    virtual = engine.virtual_ranks
    states = []
    for step in steps:
        for micro in range(case.accumulation):
            for v in virtual.of_rank(comm.rank):
                x, target = micro_batch(
                    case, (step * case.accumulation + micro) * virtual.total + v
                )
                x, target = x.to(comm.device), target.to(comm.device)
                inputs = x.to(DTYPES[case.dtype]) if not case.vocab else x
                engine.backward(loss_of(case, engine(inputs), target))
                if engine.step():
                    states.append(engine.full_state_dict())
    return states


def train_virtual(
    case: ParityCase,
    comm: Communicator,
    stage: int,
    counts: tuple[int, ...],
    settings: dict[str, Any] | None = None,
) -> list[dict[str, torch.Tensor]]:
    case = normalised(case)
    engine = build_engine(case, comm, stage, {"micro_batches_per_rank": counts, **(settings or {})})
    states = run_virtual_steps(engine, case, comm, range(case.steps))
    engine.close()
    return states


def virtual_equals_homogeneous(
    case: ParityCase,
    stage: int,
    counts: tuple[int, ...],
    settings: dict[str, Any] | None = None,
    reference_stage: int | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(states of the V-rank homogeneous run at ``reference_stage`` (default ``stage``),
    states of rank 0 of the N-rank virtual run); every rank's states are checked equal."""
    from parity import assert_same_states

    ref_stage = stage if reference_stage is None else reference_stage
    reference = run_simulated(sum(counts), lambda comm: train(case, comm, ref_stage))[0]
    runs = run_simulated(
        len(counts), lambda comm: train_virtual(case, comm, stage, counts, settings)
    )
    for rank, states in enumerate(runs):
        assert_same_states(reference, states, f"stage {stage}, counts {counts}, rank {rank}")
    return reference, runs[0]
