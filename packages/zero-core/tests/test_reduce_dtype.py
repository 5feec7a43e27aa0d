"""``ZeroConfig.reduce_dtype``: gradients of bf16/fp16 compute reduced and accumulated in
float32 (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``).

The property suite (test_stage_parity, parity.parity_cases) draws ``reduce_dtype`` with the
rest of a case, so every stage equals stage 0 bit for bit with it too. Here: the option's
spellings and refusals, a tiny case whose float32 result is known by hand (so the
float32 reduction is what happens, not a float32 copy of a bf16 sum), that it changes a
random model's result (it is not a no-op), and what ``.grad`` reads at stages 0 and 1.
"""

from __future__ import annotations

import pytest
import torch
from parity import ParityCase, train
from torch import nn

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core.grad_placeholders import is_placeholder

# One micro-batch input per (micro-step m, rank r), number m * N + r: the first is large,
# the others are below half a bf16 (and fp16) ulp of it, so a 16-bit sum drops them and
# a float32 sum keeps them exactly (every value and partial sum has < 24 significant bits).
INPUTS = torch.tensor(
    [
        [1.0, 1.0, 3.0, -0.5],
        [2.0**-12, 3 * 2.0**-13, 2.0**-12, -(2.0**-14)],
        [2.0**-13, 2.0**-12, -(2.0**-13), 2.0**-14],
        [2.0**-14, 2.0**-14, 2.0**-12, 2.0**-13],
    ]
)
START = torch.tensor([[0.5, -0.25, 1.0, 2.0]])


def one_sgd_step(
    comm: Communicator, stage: int, dtype: torch.dtype, reduce: str | None, accumulation: int
) -> torch.Tensor:
    """One SGD step (lr 1) of ``w`` in ``loss = w . x`` (so the gradient is ``x``); the
    float32 master of ``w`` after it."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(START)
    config = zero_core.ZeroConfig(
        stage=stage, param_dtype=dtype, reduce_dtype=reduce,
        gradient_accumulation_steps=accumulation, persistence_threshold=0,
        initial_loss_scale=4.0,  # fp16: exact (a power of two), and no overflow
    )  # fmt: skip
    engine = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config, comm)
    for micro in range(accumulation):
        x = INPUTS[micro * comm.world_size + comm.rank].to(dtype)
        engine.backward(engine(x).sum())
        engine.step()
    weight = engine.full_state_dict()["weight"]
    engine.close()
    return weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("ranks", "accumulation"), [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float32_reduction_equals_the_sum_by_hand(
    stage: int, ranks: int, accumulation: int, dtype: torch.dtype
) -> None:
    """w - (sum of the inputs) / (N A), computed in float64 and rounded to float32 once,
    is what reduce_dtype=float32 gives, bit for bit; reducing in the compute dtype (the
    default) drops the small inputs and gives something else. The sums over ranks (N = 2)
    and over micro-steps (A = 2 at one rank) are both checked."""
    used = INPUTS[: ranks * accumulation].double()
    expected = (START.double() - used.sum(0) / (ranks * accumulation)).float()

    def body(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        wide = one_sgd_step(comm, stage, dtype, "fp32", accumulation)
        narrow = one_sgd_step(comm, stage, dtype, None, accumulation)
        return wide, narrow

    for wide, narrow in run_simulated(ranks, body):
        assert torch.equal(wide, expected), (wide, expected)
        assert not torch.equal(narrow, expected), "the compute-dtype sum kept the small inputs"


@pytest.mark.parametrize("stage", [0, 2])
def test_float32_reduction_changes_a_random_models_result(stage: int) -> None:
    """A bf16 MLP on 3 ranks with accumulation: float32 reduction moves the parameters
    somewhere else than bf16 reduction (so the option cannot be a no-op), and not far
    (the difference is the bf16 sums' rounding)."""
    case = ParityCase(widths=(33, 130, 5), dtype="bfloat16", optimizer="sgd", accumulation=2)
    wide_case = ParityCase(**{**case.__dict__, "reduce_dtype": "float32"})

    def body(comm: Communicator) -> float:
        narrow, wide = train(case, comm, stage)[-1], train(wide_case, comm, stage)[-1]
        return max((narrow[k] - wide[k]).abs().max().item() for k in narrow)

    differences = run_simulated(3, body)
    assert all(0 < d < 1e-2 for d in differences), differences


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("overlap_comm", [True, False])
def test_stages_0_and_1_leave_grad_none_and_still_name_a_plain_backward(
    stage: int, overlap_comm: bool
) -> None:
    """A float32 buffer cannot be a bf16 parameter's .grad: after engine.backward .grad is
    a placeholder (as at every stage: grad_placeholders) and the gradient is in the
    engine's buffer; a plain
    loss.backward() leaves its gradient in .grad, which step() names as before."""

    def body(comm: Communicator) -> tuple[bool, str]:
        model = nn.Linear(4, 3)
        config = zero_core.ZeroConfig(
            stage=stage, param_dtype="bf16", reduce_dtype=torch.float32, overlap_comm=overlap_comm
        )
        engine = zero_core.initialize(model, torch.optim.SGD, config, comm)
        x = torch.ones(2, 4, dtype=torch.bfloat16)
        engine.backward(engine(x).sum())
        none_after_backward = all(is_placeholder(p.grad) for p in model.parameters())
        held = [t for t in engine.gradients.tensors() if t.numel()]
        assert held and all(t.dtype == torch.float32 and t.any() for t in held)
        engine.step()
        engine(x).sum().backward()
        with pytest.raises(RuntimeError) as error:
            engine.step()
        return none_after_backward, str(error.value)

    for none_after_backward, message in run_simulated(2, body):
        assert none_after_backward
        assert "call engine.backward(loss)" in message


@pytest.mark.parametrize("value", ["fp32", "float32", torch.float32])
def test_float32_is_accepted_in_param_dtypes_spellings(value: object) -> None:
    config = zero_core.ZeroConfig(param_dtype="bf16", reduce_dtype=value)  # type: ignore[arg-type]
    assert config.reduce_dtype is torch.float32
    assert config.gradient_dtype is torch.float32


def test_the_default_and_the_compute_dtype_reduce_as_before() -> None:
    assert zero_core.ZeroConfig(param_dtype="bf16").gradient_dtype is torch.bfloat16
    same = zero_core.ZeroConfig(param_dtype="fp16", reduce_dtype="fp16")
    assert same.gradient_dtype is torch.float16


@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "words"),
    [
        ("fp32", "bf16", "would round every torch.float32 gradient"),
        ("bf16", "fp16", "would round every torch.bfloat16 gradient"),
        ("fp16", "bf16", "would round every torch.float16 gradient"),
        ("bf16", "fp64", "'fp64' is not supported"),
        ("bf16", torch.float64, "is not supported"),
        ("bf16", 32, "is not supported"),
    ],
)
def test_other_reduce_dtypes_are_refused_naming_the_choices(
    param_dtype: str, reduce_dtype: object, words: str
) -> None:
    with pytest.raises(ValueError, match="reduce_dtype=") as error:
        zero_core.ZeroConfig(param_dtype=param_dtype, reduce_dtype=reduce_dtype)  # type: ignore[arg-type]
    assert words in str(error.value)
    assert "'fp32' / torch.float32" in str(error.value)
