"""Ranks that disagree about the sequence of collectives get an error naming the first
divergent operation, what it moves (a module's parameters or gradients, a parameter's
initial value) and every rank's call: never a hang, never mismatched data reduced.

The check is the communicator's consistency check (on by default in zero_comm.init): one
small all-gather of each call's (collective, dtype, numel, op, root, label) before the
data moves. tools/bench_stages.py runs with it on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from zero_comm import CollectiveMismatchError, Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError


def mismatch(body: object, world_size: int = 2) -> str:
    """The CollectiveMismatchError message (every rank raises one; the others may report
    the abandoned collective first)."""
    with pytest.raises(SimulatedRankError) as failure:
        run_simulated(world_size, body, timeout=20)  # type: ignore[arg-type]
    text = str(failure.value)
    assert CollectiveMismatchError.__name__ in text, text
    return text


def model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 8), nn.Linear(8, 8))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_different_number_of_micro_steps_is_named(stage: int) -> None:
    """Rank 1 accumulates two micro-steps, rank 0 one: rank 0 goes on to its update while
    rank 1 runs a second backward."""

    def body(comm: Communicator) -> None:
        m = model()
        config = zero_core.ZeroConfig(stage=stage, gradient_accumulation_steps=1 + comm.rank,
                                      persistence_threshold=0)  # fmt: skip
        engine = zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config, comm)
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 8)).sum())
            engine.step()

    message = mismatch(body)
    assert "ranks disagree on the collective: rank 0:" in message and "; rank 1:" in message
    assert "(micro-step 1 of 1)" in message and "(micro-step 1 of 2)" in message, message


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ranks_with_differently_shaped_models_are_named_at_initialize(stage: int) -> None:
    def body(comm: Communicator) -> None:
        m = model(width=8 + comm.rank)
        zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1),
                             zero_core.ZeroConfig(stage=stage), comm)  # fmt: skip

    message = mismatch(body)
    assert "numel=64" in message and "numel=72" in message, message
    if stage == 3:
        assert "'0.weight'" in message  # the broadcast of that parameter's initial value
