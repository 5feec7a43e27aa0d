"""Habits of DeepSpeed and FSDP users: each does the right thing or raises naming the fix.

- ``engine.clip_grad_norm_(max_norm)`` (FSDP's) equals ``ZeroConfig(clip_grad_norm=)``
  bit for bit at every stage, and returns the norm;
- torch's own ``clip_grad_norm_`` over the module's parameters raises (it returned 0 and
  clipped nothing: the gradients are not on ``p.grad``);
- a scheduler built on the optimizer given to ``initialize`` drives the engine, and that
  optimizer's ``step()`` raises, naming ``engine.step()``;
- ``zero_core.is_partitioned(p)`` is True at stage 3 only;
- ``module.to_empty()`` (FSDP2's meta build) after ``initialize`` raises, and
  ``values_from_reset_parameters`` does that build one submodule at a time.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    OPTIMIZERS,
    ParityCase,
    ParityModel,
    assert_same_states,
    build_engine,
    loss_of,
    micro_batch,
    normalised,
    run_steps,
)
from torch import nn

import zero_core
from zero_comm import Communicator, run_simulated


def _train_with_clip_call(
    case: ParityCase, comm: Communicator, stage: int, max_norm: float
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """As parity.run_steps, calling engine.clip_grad_norm_ before each step instead of
    configuring clipping; returns the states and the norms it returned."""
    engine = build_engine(case, comm, stage)
    states, norms = [], []
    for step in range(case.steps):
        for micro in range(case.accumulation):
            x, target = micro_batch(
                case, (step * case.accumulation + micro) * comm.world_size + comm.rank
            )
            engine.backward(loss_of(case, engine(x if case.vocab else x.to(engine.dtype)), target))
        norm = engine.clip_grad_norm_(max_norm)
        assert engine.last_grad_norm is not None
        assert norm.dtype == torch.float32  # as torch's, in the gradients' dtype
        assert float(norm) == float(torch.tensor(engine.last_grad_norm, dtype=torch.float32))
        norms.append(engine.last_grad_norm)
        if engine.step():
            states.append(engine.full_state_dict())
    engine.close()
    return states, norms


@settings(max_examples=12, deadline=None)
@given(
    stage=st.sampled_from([0, 1, 2, 3]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    accumulation=st.sampled_from([1, 2]),
    max_norm=st.sampled_from([0.05, 1e3]),
    world_size=st.sampled_from([2, 3]),
    seed=st.integers(0, 1000),
)
def test_engine_clip_grad_norm_equals_configured_clipping_bit_for_bit(
    stage: int, dtype: str, accumulation: int, max_norm: float, world_size: int, seed: int
) -> None:
    case = normalised(
        ParityCase(widths=(7, 130, 3), dtype=dtype, accumulation=accumulation, seed=seed)
    )
    configured = ParityCase(**{**case.__dict__, "clip": max_norm})

    def body(comm: Communicator) -> None:
        expected_engine = build_engine(configured, comm, 0)
        expected = run_steps(expected_engine, configured, comm, range(case.steps))
        expected_norm = expected_engine.last_grad_norm
        expected_engine.close()
        states, norms = _train_with_clip_call(case, comm, stage, max_norm)
        assert_same_states(expected, states, f"stage {stage}, clip_grad_norm_({max_norm})")
        assert norms[-1] == expected_norm

    run_simulated(world_size, body)


def test_clipping_by_call_changes_the_update() -> None:
    """The call is not a no-op: a tight max_norm gives other weights than no clipping."""
    case = ParityCase(widths=(7, 5, 3))

    def body(comm: Communicator) -> None:
        clipped, _ = _train_with_clip_call(case, comm, 2, 1e-3)
        engine = build_engine(case, comm, 2)
        plain = run_steps(engine, case, comm, range(case.steps))
        engine.close()
        assert not torch.equal(clipped[-1]["layers.0.weight"], plain[-1]["layers.0.weight"])

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_clip_grad_norm_and_reading_p_grad_raise_naming_the_engine(stage: int) -> None:
    case = ParityCase(widths=(7, 5, 3), accumulation=2)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage)
        model = engine.module
        x, target = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        clip_named, backward_named = r"engine\.clip_grad_norm_\(max_norm\)", r"engine\.backward\("
        for attempt, named in (
            (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), clip_named),
            (lambda: model.layers[0].weight.grad.norm(), clip_named),  # type: ignore[union-attr]
            # stage 3 names it before autograd reaches a .grad
            (lambda: loss_of(case, model(x), target).backward(), backward_named),  # type: ignore[no-untyped-call]
        ):
            with pytest.raises(RuntimeError, match=named):
                attempt()
        with pytest.raises(RuntimeError, match="after the last backward of the accumulation"):
            engine.clip_grad_norm_(1.0)
        engine.backward(loss_of(case, engine(x), target))  # the second micro-step still works
        engine.clip_grad_norm_(1.0)
        assert engine.step()
        assert all(p.grad is None for p in model.parameters())  # as after zero_grad
        engine.close()

    run_simulated(2, body)


def _scheduled_run(comm: Communicator, stage: int, on_user_optimizer: bool) -> list[float]:
    """Three steps under a halving LambdaLR, built on the user's optimizer before
    initialize or on engine.optimizer after; the learning rate each step used."""
    case = ParityCase(widths=(7, 5, 3))
    model = ParityModel(case)
    optimizer_class, options = OPTIMIZERS[case.optimizer]
    optimizer = optimizer_class(model.parameters(), **options)
    scheduler = None
    if on_user_optimizer:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    engine = zero_core.initialize(model, optimizer, zero_core.ZeroConfig(stage=stage), comm)
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 0.5**s)
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
        for step in range(3):
            x, target = micro_batch(case, step * comm.world_size + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            used.append(engine.optimizer.param_groups[0]["lr"])
            engine.step()
            scheduler.step()
            optimizer.zero_grad()  # the FSDP loop's: nothing to do after engine.step()
    used.append(engine.full_state_dict()["layers.0.weight"].sum().item())
    engine.close()
    return used


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_scheduler_built_on_the_user_optimizer_drives_the_engine(stage: int) -> None:
    lr = OPTIMIZERS["adamw"][1]["lr"]
    before = run_simulated(2, lambda comm: _scheduled_run(comm, stage, True))[0]
    after = run_simulated(2, lambda comm: _scheduled_run(comm, stage, False))[0]
    assert before[:3] == [lr, lr / 2, lr / 4]
    assert before == after  # the same rates, and the same final weights


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_user_optimizer_raises_where_it_would_train_wrongly(stage: int) -> None:
    case = ParityCase(widths=(7, 5, 3), accumulation=2)

    def body(comm: Communicator) -> None:
        model = ParityModel(case)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = zero_core.ZeroConfig(stage=stage, gradient_accumulation_steps=2)
        engine = zero_core.initialize(model, optimizer, config, comm)
        optimizer.zero_grad()  # at a boundary: nothing to drop
        x, target = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        with pytest.raises(RuntimeError, match=r"Call engine\.step\(\) instead of optimizer"):
            optimizer.step()
        with pytest.raises(RuntimeError, match="would drop the accumulated gradients"):
            optimizer.zero_grad()
        for refused in (optimizer.state_dict, lambda: optimizer.load_state_dict({})):
            with pytest.raises(RuntimeError, match=r"engine\.save\(path\)"):
                refused()
        with pytest.raises(ValueError, match=r"already given to zero_core\.initialize"):
            zero_core.initialize(ParityModel(case), optimizer, config, comm)
        engine.close()

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_is_partitioned_is_true_at_stage_3_only(stage: int) -> None:
    def body(comm: Communicator) -> None:
        engine = build_engine(ParityCase(), comm, stage)
        weight = engine.module.layers[0].weight
        assert zero_core.is_partitioned(weight) == (stage == 3)
        assert not zero_core.is_partitioned(torch.zeros(3))
        engine.close()
        assert not zero_core.is_partitioned(weight)

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [0, 3])
def test_conversions_that_replace_parameters_raise_after_initialize(stage: int) -> None:
    def body(comm: Communicator) -> None:
        engine = build_engine(ParityCase(), comm, stage)
        model = engine.module
        model.to("cpu").float().train()  # the same device and dtype: nothing is replaced
        for convert, name in (
            (lambda: model.to_empty(device="cpu"), "to_empty"),
            (lambda: model.half(), "half"),
            (lambda: model.to(torch.float64), "to"),
        ):
            with pytest.raises(RuntimeError, match=rf"module\.{name}\(\) after zero_core"):
                convert()
        assert model.layers[0].weight.dtype == torch.float32
        engine.close()
        model.to(torch.float64)  # a closed engine's module is the user's again

    run_simulated(2, body)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def test_values_from_reset_parameters_equal_a_whole_build_with_the_same_seed() -> None:
    """One rank (the rank threads of a simulated world share torch's global RNG)."""

    def body(comm: Communicator) -> None:
        torch.manual_seed(5)
        whole = _Block()
        torch.manual_seed(5)
        with torch.device("meta"):
            meta = _Block()
        engine = zero_core.initialize(
            meta,
            torch.optim.SGD(meta.parameters(), lr=0.1),
            zero_core.ZeroConfig(stage=3),
            comm,
            init_values=zero_core.values_from_reset_parameters(meta),
        )
        got = engine.full_state_dict()
        for name, value in whole.state_dict().items():
            assert torch.equal(got[name], value), name
        engine.close()

    run_simulated(1, body)


def test_values_from_reset_parameters_name_what_they_cannot_set() -> None:
    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    class LostBuffer(nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 3)
            self.register_buffer("table", torch.arange(3.0))

    with torch.device("meta"):
        no_reset, lost = NoReset(), LostBuffer()
    with pytest.raises(ValueError, match=r"no reset_parameters\(\)"):
        list(zero_core.values_from_reset_parameters(no_reset))
    with pytest.raises(ValueError, match=r"table is still unset after LostBuffer"):
        list(zero_core.values_from_reset_parameters(lost))


def test_a_stage_3_state_dict_outside_a_gathered_block_raises_instead_of_nan() -> None:
    """model.state_dict() read the released parameters' NaN placeholders, exit 0 (the
    trap of DeepSpeed-aware export code); inside gathered_parameters it is whole."""
    case = ParityCase(widths=(7, 130, 3), persistence_threshold=0)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3)
        model = engine.module
        for read in (model.state_dict, model.layers[1].state_dict):
            with pytest.raises(RuntimeError, match=r"engine\.full_state_dict\(rank=0\)"):
                read()
        with engine.gathered_parameters():
            inside = model.state_dict()
        full = engine.full_state_dict()
        assert all(torch.equal(inside[k].float(), full[k]) for k in full)
        engine.close()

    run_simulated(2, body)


def test_the_fsdp2_port_of_docs_coming_from_fsdp2_trains() -> None:
    """The zero_core loop of docs/coming-from-fsdp2.md, as written there: a meta build,
    bf16 compute with float32 reduction, engine.clip_grad_norm_, two ranks."""

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 16)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
            self.head = nn.Linear(16, 11)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    def body(comm: Communicator) -> list[float]:
        with torch.device("meta"):
            model = Transformer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        config = zero_core.ZeroConfig(stage=3, param_dtype="bf16", reduce_dtype="fp32")
        engine = zero_core.initialize(
            model, optimizer, config, comm,
            init_values=zero_core.values_from_reset_parameters(model),
        )  # fmt: skip
        generator = torch.Generator().manual_seed(comm.rank)
        x = torch.randint(0, 11, (4, 6), generator=generator)
        losses = []
        for _ in range(6):
            loss = nn.functional.cross_entropy(engine(x).float().reshape(-1, 11), x.reshape(-1))
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses

    for losses in run_simulated(2, body):
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
