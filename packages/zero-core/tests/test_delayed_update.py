"""ZeroConfig.delayed_parameter_update (zero_core.delayed_update): every step's update is
applied one step late, bit for bit.

The reference is the synchronous engine (stage 1, masters on the host, so its compute
parameters are a separate copy it may be driven through) made to compute each step's
gradients at the parameters of two updates back: before step t's forward the test writes
the parameters published at step t-2 into the module, then ``step()`` applies g_t to the
masters of step t-1 and publishes M_t, as usual. So P_t = M_{t-2} and M_t =
update(M_{t-1}, g_t): the delayed update's contract, without a thread. Every stage
equals stage 1 bit for bit (test_stage_parity), so one reference serves stages 1-3.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    DTYPES,
    ParityCase,
    assert_same_states,
    build_engine,
    loss_of,
    micro_batch,
    normalised,
    offloaded_parity_cases,
)

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core.delayed_update import DelayedUpdateError

DPU = {"delayed_parameter_update": True}
CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                  dtype="bfloat16", bucket_numel=300, persistence_threshold=0,
                  sub_group_numel=64, accumulation=2, clip=0.05, steps=4,
                  offload_optimizer="cpu")  # fmt: skip


def case_with(case: ParityCase, **fields: Any) -> ParityCase:
    return normalised(ParityCase(**{**case.__dict__, **fields}))


def trainable(engine: zero_core.ZeroEngine) -> list[torch.nn.Parameter]:
    return [p for p in engine.module.parameters() if p.requires_grad]


def train_step(engine: zero_core.ZeroEngine, case: ParityCase, comm: Communicator,
               step: int) -> bool:  # fmt: skip
    """Step ``step``'s micro-batches (parity.train's global numbering); whether the last
    ``engine.step()`` applied (launched) an update."""
    applied = False
    for micro in range(case.accumulation):
        x, target = micro_batch(case, (step * case.accumulation + micro) * comm.world_size
                                + comm.rank)  # fmt: skip
        x, target = x.to(comm.device), target.to(comm.device)
        loss = loss_of(case, engine(x.to(DTYPES[case.dtype]) if not case.vocab else x), target)
        engine.backward(loss)
        applied = engine.step()
    return applied


def delayed_reference(
    case: ParityCase, comm: Communicator, *, flush_at: int | None = None,
    schedule: bool = False, settings: dict[str, Any] | None = None,
) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """The synchronous engine driven to apply every update one step late (module
    docstring); the full state after every applied step. ``flush_at=k``: after step k the
    parameters of step k are current (what a save does to the delayed run)."""
    reference = case_with(case, offload_optimizer="cpu", offload_params="none")
    engine = build_engine(reference, comm, 1, settings)
    if schedule:
        engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: 1.0 / (1 + s)
        )
    params = trainable(engine)
    previous = [p.detach().clone() for p in params]  # P_t for the coming step
    states = []
    for step in range(case.steps):
        current = [p.detach().clone() for p in params]  # M_{t-1}, published at t-1
        with torch.no_grad():
            for p, value in zip(params, previous, strict=True):
                p.copy_(value)
        if train_step(engine, reference, comm, step):
            states.append(engine.full_state_dict())
        else:  # skipped: the synchronous engine keeps M_{t-1} published
            with torch.no_grad():
                for p, value in zip(params, current, strict=True):
                    p.copy_(value)
        previous = current
        if flush_at is not None and step + 1 == flush_at:
            previous = [p.detach().clone() for p in params]
    engine.close()
    return states


def delayed_run(
    case: ParityCase, comm: Communicator, stage: int, *, settings: dict[str, Any] | None = None,
    schedule: bool = False, slow: float = 0.0, reports: bool = False,
) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """``case`` with the delayed update at ``stage``; the full state after every applied
    step. ``slow``: seconds each background update sleeps first (a missing wait or a
    shared tensor then shows up as a mismatch); ``reports``: read memory_report and the
    gradient norm after each step (reads that must not change the run)."""
    engine = build_engine(case, comm, stage, {**DPU, **(settings or {})})
    if schedule:
        engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: 1.0 / (1 + s)
        )
    if slow:
        engine.optimizer.register_step_pre_hook(lambda *_: time.sleep(slow))
    states = []
    for step in range(case.steps):
        if train_step(engine, case, comm, step):
            if reports:
                engine.memory_report()
            states.append(engine.full_state_dict())
    engine.close()
    return states


def delayed_equals_reference(comm: Communicator, case: ParityCase,
                             stages: tuple[int, ...] = (1, 2, 3), **run: Any) -> None:  # fmt: skip
    expected = delayed_reference(
        case, comm, schedule=run.get("schedule", False), settings=run.get("settings")
    )
    for stage in stages:
        actual = delayed_run(case, comm, stage, **run)
        assert_same_states(expected, actual, f"delayed update, stage {stage}, {case}")


# ---------------------------------------------------------------- the contract
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_every_update_is_applied_one_step_late_bit_for_bit(world_size: int, tier: str) -> None:
    """Stages 1-3, host and disk tiers, accumulation and clipping, bfloat16: the delayed
    run equals the reference after every step; at stage 3 with the parameters on the
    tier too."""
    case = case_with(CASE, offload_optimizer=tier, offload_params=tier)
    run_simulated(world_size, lambda comm: delayed_equals_reference(comm, case))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float32_gradients_are_owned_and_float16_scaling_stays_exact(dtype: str) -> None:
    """float32: the update's gradients are the gradient shard itself, which zero_grad
    frees and the next backward refills, so they must be copies (a slow update makes a
    shared one show). float16: the skip decision and the scale's update are the
    launching step's: with the scale doubled after every applied step and halved after
    every overflow, skipped steps come between applied ones (so a skip publishes a
    pending update: [skip, apply, skip, apply, apply, skip, skip, apply, apply, skip]).
    Both equal the reference."""
    case = case_with(CASE, dtype=dtype, steps=10)
    scaling = {"loss_scale_window": 1, "hysteresis": 1} if dtype == "float16" else {}

    def body(comm: Communicator) -> None:
        delayed_equals_reference(comm, case, slow=0.02, settings=scaling)
        if dtype == "float16":  # skips after applied steps happened
            engine = build_engine(case, comm, 2, {**DPU, **scaling})
            applied = [train_step(engine, case, comm, step) for step in range(case.steps)]
            engine.close()
            assert any(a and not b for a, b in itertools.pairwise(applied)), applied

    run_simulated(2, body)


def test_the_delay_is_real() -> None:
    """The delayed run is not the synchronous one: after step 2 their states differ
    (the reference's do not, step by step, so the comparison above can fail)."""
    case = case_with(CASE, steps=3)

    def body(comm: Communicator) -> None:
        synchronous = build_engine(case, comm, 2)
        plain = []
        for step in range(case.steps):
            train_step(synchronous, case, comm, step)
            plain.append(synchronous.full_state_dict())
        synchronous.close()
        delayed = delayed_run(case, comm, 2)
        assert all(torch.equal(plain[0][k], delayed[0][k]) for k in plain[0])  # same M_1
        assert not all(torch.equal(plain[1][k], delayed[1][k]) for k in plain[1])

    run_simulated(2, body)


def test_a_scheduler_stepped_during_the_update_sets_the_next_one() -> None:
    """The engine's scheduler steps right after the launch, while the (slow) update runs:
    the update uses the options of its own step (a snapshot), as without the delay."""
    case = case_with(CASE, steps=4)
    run_simulated(2, lambda comm: delayed_equals_reference(
        comm, case, stages=(2,), schedule=True, slow=0.02))  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_many_steps_at_world_size_2_without_a_race(threads: int) -> None:
    """Many steps, a slow update, reads of memory_report and full_state_dict between
    steps, under 1 and 2 intra-op threads: still the reference's bits."""
    case = case_with(CASE, steps=12, accumulation=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_simulated(2, lambda comm: delayed_equals_reference(
            comm, case, stages=(2, 3), slow=0.005, reports=True))  # fmt: skip
    finally:
        torch.set_num_threads(before)


@settings(max_examples=8, deadline=None)
@given(case=offloaded_parity_cases(), world_size=st.sampled_from([1, 2, 3]))
def test_drawn_cases_apply_every_update_one_step_late(case: ParityCase, world_size: int) -> None:
    """Any drawn model, precision, optimizer, accumulation, clipping, tiers and sizes (the
    offloaded parity cases, optimizer always offloaded), three steps."""
    if case.offload_optimizer == "none":
        case = case_with(case, offload_optimizer="cpu")
    case = case_with(case, steps=3)
    run_simulated(world_size, lambda comm: delayed_equals_reference(comm, case))


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("stage", [1, 3])
def test_save_and_resume_equal_the_run_that_saved(stage: int, tmp_path: Path) -> None:
    """Save after step 2 (the save waits for step 2's update and publishes it), load into
    a fresh engine and go on: equal, bit for bit, to the uninterrupted run that saved at
    step 2, and to the reference flushed at step 2. The checkpoint holds step 2's state."""
    case = case_with(CASE, steps=5, offload_optimizer="disk", offload_params="disk")
    saved_at = 2

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage, DPU)
        straight = []
        for step in range(case.steps):
            train_step(engine, case, comm, step)
            if step + 1 == saved_at:
                assert engine.delayed_update is not None and engine.delayed_update.in_flight
                engine.save(tmp_path / f"ckpt{stage}")
                assert not engine.delayed_update.pending
                at_save = engine.full_state_dict()
            straight.append(engine.full_state_dict())
        engine.close()
        resumed = build_engine(case, comm, stage, DPU)
        resumed.load(tmp_path / f"ckpt{stage}")
        assert resumed.global_steps == saved_at
        loaded = resumed.full_state_dict()
        assert all(torch.equal(loaded[k], at_save[k]) for k in at_save)
        rest = []
        for step in range(saved_at, case.steps):
            train_step(resumed, case, comm, step)
            rest.append(resumed.full_state_dict())
        resumed.close()
        assert_same_states(straight[saved_at:], rest, f"resumed at stage {stage}")
        expected = delayed_reference(case, comm, flush_at=saved_at)
        assert_same_states(expected, straight, f"flushed at step {saved_at}, stage {stage}")

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_flush_and_reads_do_not(stage: int) -> None:
    """After step 2 the compute parameters are M_0 (the delay); full_state_dict and
    memory_report wait for step 2's update but leave them so; gathered_parameters
    publishes it: inside, the parameters are M_2, the state after every step taken."""
    case = case_with(CASE, dtype="float32", steps=2)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage, DPU)
        with engine.gathered_parameters():
            initial = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        for step in range(case.steps):
            train_step(engine, case, comm, step)
        masters = engine.full_state_dict()
        engine.memory_report()
        assert engine.delayed_update is not None and engine.delayed_update.pending
        with engine.gathered_parameters():
            for name, p in engine.module.named_parameters():
                assert torch.equal(p.detach(), masters[name]), name
                assert not torch.equal(p.detach(), initial[name]), name
        assert not engine.delayed_update.pending
        engine.close()

    run_simulated(2, body)


# ---------------------------------------------------------------- failures
def test_a_failure_in_the_update_is_raised_at_the_next_step_with_its_traceback() -> None:
    case = case_with(CASE, steps=4)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2, DPU)
        calls = []

        def fail_second(*_: Any) -> None:
            calls.append(threading.current_thread().name)
            if len(calls) == 2:
                raise OSError(28, "No space left on device (injected)")

        engine.optimizer.register_step_pre_hook(fail_second)
        train_step(engine, case, comm, 0)
        train_step(engine, case, comm, 1)  # launches the update that fails
        with pytest.raises(OSError, match="injected") as raised:
            train_step(engine, case, comm, 2)
        assert calls[0].startswith("zero-delayed-update-rank"), calls
        frames = [f.name for f in __import__("traceback").extract_tb(raised.value.__traceback__)]
        assert "fail_second" in frames, frames  # the background thread's own frames
        notes = getattr(raised.value, "__notes__", None)  # (add_note: Python 3.11+)
        if sys.version_info >= (3, 11):
            assert notes and any("delayed parameter update of step 2" in n for n in notes)
        with pytest.raises(DelayedUpdateError, match=r"step 2 failed.*load the last checkpoint"):
            engine.step()
        with pytest.raises(DelayedUpdateError, match="step 2 failed"):
            engine.full_state_dict()
        engine.close()  # closing does not raise it again

    run_simulated(1, body)


def test_a_flush_raises_the_failure_too() -> None:
    case = case_with(CASE, steps=1)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 1, DPU)
        engine.optimizer.register_step_pre_hook(lambda *_: 1 / 0)
        train_step(engine, case, comm, 0)
        with pytest.raises(ZeroDivisionError):
            engine.full_state_dict()
        engine.close()

    run_simulated(1, body)


# ---------------------------------------------------------------- configuration
def test_the_delayed_update_needs_the_optimizer_offloaded() -> None:
    with pytest.raises(ValueError, match=r"needs the optimizer offloaded.*offload_optimizer='cpu'"):
        zero_core.ZeroConfig(stage=2, delayed_parameter_update=True)
    with pytest.raises(ValueError, match=r"optimizer_in_backward=True.*no step left to delay"):
        zero_core.ZeroConfig(stage=3, optimizer_in_backward=True, nonfinite="raise",
                             delayed_parameter_update=True)  # fmt: skip
    with pytest.raises(ValueError, match="must be True or False"):
        zero_core.ZeroConfig(stage=2, offload_optimizer="cpu", delayed_parameter_update=1)
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        zero_core.ZeroConfig(stage=0, offload_optimizer="cpu", delayed_parameter_update=True)
    config = zero_core.ZeroConfig(stage=2, offload_optimizer="cpu", delayed_parameter_update=True)
    assert config.delayed_parameter_update
    assert not zero_core.ZeroConfig().delayed_parameter_update
