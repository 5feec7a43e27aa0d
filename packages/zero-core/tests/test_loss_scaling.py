"""float16 loss scaling: overflow skips the step on every rank alike and backs the scale off."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core.loss_scaler import LossScaler


@given(st.lists(st.booleans(), max_size=60), st.integers(1, 5), st.integers(1, 3))
def test_dynamic_scale_follows_the_rule(
    overflows: list[bool], window: int, hysteresis: int
) -> None:
    scaler = LossScaler(2.0**10, window=window, hysteresis=hysteresis, minimum=1.0)
    scale, good, left = 2.0**10, 0, hysteresis
    for overflow in overflows:
        scaler.update(overflow)
        if overflow:
            good, left = 0, left - 1
            if left == 0:
                scale, left = max(scale / 2, 1.0), hysteresis
        else:
            good += 1
            if good % window == 0:
                scale, left = scale * 2, hysteresis
        assert scaler.scale == scale


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_on_one_rank_skips_the_step_everywhere(stage: int) -> None:
    def body(comm: Communicator) -> tuple[bool, float, bool]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        config = zero_core.ZeroConfig(stage=stage, param_dtype="fp16", hysteresis=1)
        engine = zero_core.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config, comm
        )
        before = engine.full_state_dict()
        x = torch.full((2, 4), 1e4 if comm.rank == 1 else 1.0, dtype=torch.float16)
        engine.backward(engine(x).float().sum())
        applied = engine.step()
        after = engine.full_state_dict()
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        return applied, engine.loss_scaler.scale, unchanged

    results = run_simulated(3, body)
    assert results == [(False, 2.0**15, True)] * 3


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_nan_gradient_never_reaches_the_parameters(stage: int, dtype: str) -> None:
    """skip: the step is skipped on every rank; raise: every rank names the parameter."""

    def body(comm: Communicator) -> tuple[bool, bool, str]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        outcomes = []
        for policy in ("skip", "raise"):
            config = zero_core.ZeroConfig(stage=stage, param_dtype=dtype, nonfinite=policy)
            engine = zero_core.initialize(
                model, torch.optim.SGD(model.parameters(), lr=0.1), config, comm
            )
            before = engine.full_state_dict()
            bad = float("nan") if comm.rank == 1 else 1.0
            x = torch.full((2, 4), bad, dtype=config.param_dtype)
            engine.backward(engine(x).float().sum())
            try:
                outcomes.append(engine.step())
            except FloatingPointError as exc:
                outcomes.append(str(exc))
            after = engine.full_state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before)
        return tuple(outcomes)  # type: ignore[return-value]

    for skipped, message in run_simulated(2, body):
        assert skipped is False
        assert "parameter 0.weight is NaN or Inf" in message


def test_the_config_loader_raises_only_value_error_on_any_json() -> None:
    from hypothesis import settings

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=8,
    )
    keys = st.sampled_from(["zero_optimization", "bf16", "fp16", "gradient_accumulation_steps",
                            "gradient_clipping", "stage", "enabled", "reduce_bucket_size",
                            "loss_scale", "initial_scale_power", "hysteresis"])  # fmt: skip
    configs = st.dictionaries(keys, json_values | st.dictionaries(keys, json_values), max_size=4)

    @settings(max_examples=300, deadline=None)
    @given(configs)
    def fuzz(config: dict) -> None:  # type: ignore[type-arg]
        with contextlib.suppress(ValueError):  # anything else fails the test
            zero_core.ZeroConfig.from_deepspeed(config)

    fuzz()
