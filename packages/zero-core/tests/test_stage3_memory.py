"""Stage 3 holds no memory past its last use (issue 17): a gathered unit's storage is
freed as soon as backward has every one of its gradients, and the communicator's staging
buffers, used once per backward, do not stay in the pool through the optimizer step and
the next forward. Stage 3 stays equal to stage 0 bit for bit (the parity suites)."""

from __future__ import annotations

import pytest
import torch
from parity import ParityCase, build_engine, loss_of, micro_batch

from zero_comm import Communicator, run_simulated
from zero_core.component_access import reduce_scattered_gradients, sharded_parameters
from zero_core.gather_unit import UnitState

WIDTHS = (64, 64, 64, 64, 64, 64)


def unit_storage_after_its_gradients(comm: Communicator, prefetch: int) -> list[str]:
    """Every time a gradient arrives in backward: the units that have all their gradients
    and no running module, but still hold storage (each entry names one)."""
    case = ParityCase(widths=WIDTHS, persistence_threshold=0)
    engine = build_engine(case, comm, 3)
    gatherer = sharded_parameters(engine).gatherer
    gatherer.prefetch_numel = prefetch
    outlived: list[str] = []
    checked = [0]

    def after_gradient(slot: object) -> None:
        for unit in gatherer.units:
            if unit.persistent or unit.users or unit.grads_seen < len(unit.slots):
                continue
            checked[0] += 1
            held = sum(full.untyped_storage().nbytes() for full in unit.fulls)
            if held or unit.state is not UnitState.RELEASED:
                outlived.append(f"{unit.label}: {unit.state.value}, {held} bytes")

    # After the stage's own listener (which releases the unit), as a user's would run.
    reduce_scattered_gradients(engine).gradient_listeners.append(after_gradient)
    for step in range(3):
        x, target = micro_batch(case, step * 2 + comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        engine.step()
    assert checked[0] >= 3 * (len(WIDTHS) - 1), "the check ran for every unit of every step"
    assert gatherer.live_numel == 0, "nothing stays gathered after backward"
    return outlived


@pytest.mark.parametrize("prefetch", [0, 1 << 30])
def test_a_unit_is_freed_once_backward_has_all_its_gradients(prefetch: int) -> None:
    """With or without prefetching, no unit holds storage once its last gradient arrived."""
    for outlived in run_simulated(2, lambda comm: unit_storage_after_its_gradients(comm, prefetch)):
        assert outlived == []


def pool_bytes_by_phase(comm: Communicator) -> list[tuple[str, int]]:
    """The communicator pool's bytes after each phase of three steps, and the most it held
    inside backward (while gradients were being reduced)."""
    case = ParityCase(widths=WIDTHS, persistence_threshold=0)
    engine = build_engine(case, comm, 3)
    in_backward = [0]

    def during_backward(slot: object) -> None:
        in_backward[0] = max(in_backward[0], comm.buffers.bytes_held)

    reduce_scattered_gradients(engine).gradient_listeners.append(during_backward)
    seen = []
    for step in range(3):
        x, target = micro_batch(case, step * 2 + comm.rank)
        loss = loss_of(case, engine(x), target)
        seen.append(("forward", comm.buffers.bytes_held))
        engine.backward(loss)
        seen.append(("backward", comm.buffers.bytes_held))
        engine.step()
        seen.append(("step", comm.buffers.bytes_held))
    seen.append(("inside backward", in_backward[0]))
    return seen


def test_staging_buffers_do_not_outlive_backward() -> None:
    """The gradient buckets' staging comes from the pool during backward and goes back to
    the allocator when backward ends: the optimizer step and the next forward, which use
    none, do not carry it."""
    for seen in run_simulated(2, pool_bytes_by_phase):
        *phases, (_, inside) = seen
        assert inside > 0, "backward staged its gradient buckets in the pool"
        assert phases == [(name, 0) for name, _ in phases]


def test_stage3_with_released_staging_still_equals_stage0() -> None:
    """Releasing the pool after every backward changes where buffers live, not a bit of
    the result: three steps of stage 3 equal stage 0's parameters exactly."""
    case = ParityCase(widths=(7, 15, 64, 3), persistence_threshold=0)

    def train(comm: Communicator, stage: int) -> dict[str, torch.Tensor]:
        engine = build_engine(case, comm, stage)
        for step in range(3):
            x, target = micro_batch(case, step * 2 + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            engine.step()
        return engine.full_state_dict()

    stage0 = run_simulated(2, lambda comm: train(comm, 0))[0]
    stage3 = run_simulated(2, lambda comm: train(comm, 3))[0]
    for key, value in stage0.items():
        assert torch.equal(value, stage3[key]), key
