"""Ranks that disagree about the sequence of collectives get an error naming the first
divergent operation, what it moves (a module's parameters or gradients, a parameter's
initial value) and every rank's call: never a hang, never mismatched data reduced.

The check is the communicator's consistency check, in both its modes: "every" (one small
all-gather of each call's (collective, dtype, numel, op, root, label) before the data
moves) and "digest" (zero_comm.init's default: only calls not agreed before in the same
place are compared, out of band; a training loop's later steps compare nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from zero_comm import CollectiveMismatchError, Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError

MODES = pytest.mark.parametrize("mode", ["every", "digest"])


def mismatch(body: object, mode: str, world_size: int = 2) -> str:
    """The CollectiveMismatchError message (every rank raises one; the others may report
    the abandoned collective first)."""
    with pytest.raises(SimulatedRankError) as failure:
        run_simulated(world_size, body, timeout=20, check_consistency=mode)  # type: ignore[arg-type]
    text = str(failure.value)
    assert CollectiveMismatchError.__name__ in text, text
    return text


def model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 8), nn.Linear(8, 8))


@MODES
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_different_number_of_micro_steps_is_named(stage: int, mode: str) -> None:
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

    message = mismatch(body, mode)
    assert "ranks disagree on the collective: rank 0:" in message and "; rank 1:" in message
    assert "(micro-step 1 of 1)" in message and "(micro-step 1 of 2)" in message, message


@MODES
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ranks_with_differently_shaped_models_are_named_at_initialize(
    stage: int, mode: str
) -> None:
    def body(comm: Communicator) -> None:
        m = model(width=8 + comm.rank)
        zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1),
                             zero_core.ZeroConfig(stage=stage), comm)  # fmt: skip

    message = mismatch(body, mode)
    assert "numel=64" in message and "numel=72" in message, message
    if stage == 3:
        assert "'0.weight'" in message  # the broadcast of that parameter's initial value


@MODES
@pytest.mark.parametrize("stage", [2, 3])
def test_a_divergence_after_several_agreeing_steps_is_named(stage: int, mode: str) -> None:
    """In step 4, rank 1 alone runs an extra forward (stage 3 gathers parameters for it) or,
    at stage 2, all-reduces its loss for a log line: by then "digest" has learned the loop
    and compares nothing, until this call."""

    def body(comm: Communicator) -> None:
        m = model()
        config = zero_core.ZeroConfig(stage=stage, persistence_threshold=0,
                                      gradient_accumulation_steps=2)  # fmt: skip
        engine = zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config, comm)
        for step in range(6):
            for _ in range(2):
                loss = engine(torch.ones(2, 8)).sum()
                engine.backward(loss)
            if comm.rank == 1 and step == 4:
                if stage == 3:
                    with torch.no_grad():
                        engine(torch.ones(2, 8))
                else:
                    comm.all_reduce(loss.detach().reshape(1), label="loss for the log")
            engine.step()

    message = mismatch(body, mode)
    assert "ranks disagree on the collective: rank 0:" in message, message
    assert "'parameters of 0'" in message if stage == 3 else "all_reduce(" in message, message


def test_digest_compares_nothing_once_the_training_loop_is_learned() -> None:
    """A call is compared while the 8 calls before it are new (call_schedule.WINDOW): here
    7 calls in the first step and 5 from the second on (forward keeps the units backward
    starts with: param_gatherer), so into the fourth step; nothing from the fifth on."""

    def body(comm: Communicator) -> list[int]:
        m = model()
        config = zero_core.ZeroConfig(stage=3, persistence_threshold=0)
        engine = zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config, comm)
        compared = []
        for _ in range(6):
            before = comm.compared_calls
            engine.backward(engine(torch.ones(2, 8)).sum())
            engine.step()
            compared.append(comm.compared_calls - before)
        return compared

    for compared in run_simulated(2, body, check_consistency="digest"):
        assert compared[0] > 0 and compared[4:] == [0, 0], compared
