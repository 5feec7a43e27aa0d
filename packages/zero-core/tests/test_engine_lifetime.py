"""An engine, once closed and dropped, leaves nothing behind: its model's parameters and
its gradient buffers are freed.

Found by tools/peers/bench.py, whose ranks build ten engines in one process: each stage-0
engine of 19M parameters left 435 MiB alive after ``close()``, ``del`` and
``gc.collect()``, and four ranks of the 101M benchmark ran out of memory. The gradient
hooks held their slots, which hold the parameters; torch keeps a parameter's hooks in its
C++ autograd metadata, where Python's garbage collector cannot see the cycle.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from parity import ParityCase, build_engine, loss_of, micro_batch, run_steps

from zero_comm import Communicator, run_simulated

CASE = ParityCase(widths=(8, 16, 4), bucket_numel=64, steps=1)


def freed_after_close(comm: Communicator, case: ParityCase, stage: int) -> list[str]:
    """Build, train one step, close and drop an engine; the names of what is still alive."""
    engine = build_engine(case, comm, stage)
    assert len(run_steps(engine, case, comm, range(1))) == 1  # the step was applied
    watched = {name: weakref.ref(p) for name, p in engine.module.named_parameters()}
    watched["engine"] = weakref.ref(engine)
    grads = [g for g in engine.gradients.tensors() if g.numel()]
    watched |= {f"gradient buffer {k}": weakref.ref(g) for k, g in enumerate(grads)}
    engine.close()
    del engine, grads
    gc.collect()
    return [name for name, ref in watched.items() if ref() is not None]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 2], ids=["no-accumulation", "accumulation"])
def test_a_dropped_engine_frees_its_parameters_and_gradients(stage: int, accumulation: int) -> None:
    case = dataclasses.replace(CASE, accumulation=accumulation)
    alive = run_simulated(2, lambda comm: freed_after_close(comm, case, stage))
    assert alive == [[], []], f"stage {stage}: still alive after close and gc: {alive}"


def test_the_hooks_of_a_dropped_engine_do_nothing() -> None:
    """The model outlives its engine: training it with plain torch afterwards works, and
    the old engine's hooks (which hold it weakly) neither fail nor keep it alive."""

    def body(comm: Communicator) -> None:
        engine = build_engine(CASE, comm, 2)
        model = engine.module
        engine.close()
        del engine
        gc.collect()
        x, target = micro_batch(CASE, comm.rank)
        loss_of(CASE, model(x), target).backward()  # type: ignore[no-untyped-call]
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        assert not any(torch.isnan(p.grad).any() for p in model.parameters() if p.grad is not None)

    run_simulated(2, body)
