"""Floating-point inputs are cast to the compute dtype, as FSDP2 does, so that float32 data
feeds a bfloat16 or float16 model; integer inputs and other objects pass untouched."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn

import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.forward_inputs import cast_floating


class Pair(NamedTuple):
    x: torch.Tensor
    ids: torch.Tensor


def test_cast_floating_reaches_into_containers_and_leaves_the_rest() -> None:
    x, ids = torch.ones(2), torch.arange(3)
    cast = cast_floating(([x, {"k": x, "ids": ids}], Pair(x, ids), "text", 3.0), torch.bfloat16)
    (listed, pair, text, number) = cast
    assert listed[0].dtype == listed[1]["k"].dtype == pair.x.dtype == torch.bfloat16
    assert listed[1]["ids"] is ids and pair.ids is ids and isinstance(pair, Pair)
    assert (text, number) == ("text", 3.0)
    assert cast_floating(x, torch.float32) is x  # nothing to do: the same tensor


torch.manual_seed(0)
MODEL = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))


def model() -> nn.Module:
    """A copy of one model (simulated ranks are threads: they must not share its RNG)."""
    import copy

    return copy.deepcopy(MODEL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float32_inputs_train_a_bfloat16_model_at_every_stage(stage: int) -> None:
    """The README's bf16 example: float32 data straight into engine(x); the parameters
    after two steps equal stage 0's, whose inputs were cast the same way."""

    def body(comm: Communicator) -> dict[str, torch.Tensor]:
        engine = zero_core.initialize(model(), torch.optim.AdamW, zero_core.ZeroConfig(
            stage=stage, param_dtype="bf16", persistence_threshold=0), comm,
            optimizer_kwargs={"lr": 1e-2})  # fmt: skip
        for step in range(2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank + 10 * step))
            out = engine(x)
            assert out.dtype == torch.bfloat16
            engine.backward(out.float().square().mean())
            engine.step()
        return engine.full_state_dict()

    got = run_simulated(2, body)[0]
    reference = run_simulated(2, lambda comm: _stage0(comm))[0]
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def _stage0(comm: Communicator) -> dict[str, torch.Tensor]:
    engine = zero_core.initialize(model(), torch.optim.AdamW, zero_core.ZeroConfig(
        stage=0, param_dtype="bf16", cast_forward_inputs=False), comm,
        optimizer_kwargs={"lr": 1e-2})  # fmt: skip
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank + 10 * step))
        engine.backward(engine(x.bfloat16()).float().square().mean())
        engine.step()
    return engine.full_state_dict()


def test_without_the_cast_a_float32_input_meets_torchs_dtype_error() -> None:
    def body(comm: Communicator) -> None:
        engine = zero_core.initialize(model(), torch.optim.AdamW, zero_core.ZeroConfig(
            stage=2, param_dtype="bf16", cast_forward_inputs=False), comm)  # fmt: skip
        engine(torch.randn(4, 6))

    with pytest.raises(SimulatedRankError) as failure:
        run_simulated(1, body)
    assert "dtype" in str(failure.value.__cause__)


def test_cast_forward_inputs_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="cast_forward_inputs='yes' must be True or False"):
        zero_core.ZeroConfig(cast_forward_inputs="yes")  # type: ignore[arg-type]
