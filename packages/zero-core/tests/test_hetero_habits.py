"""What DeepSpeed / Lightning / HF Trainer users do by habit with issue 52's options
(micro_batches_per_rank, shard_weights), and what happens: each habit works, or fails
naming the setting and its fix, never a hang, an ignored setting or a silent other run.

1. A loop calling engine.backward once per micro-step on every rank (the slots forgotten):
   the first collective outside the gradient stream (a loss print, the end of the run)
   meets a gradient row collective; the CollectiveMismatchError names the counts.
2. Lightning's ZeroStrategy and the HF ZeroTrainer refuse uneven counts (their loops give
   every rank one backward per batch) and keep shard_weights.
3. A DeepSpeed config holding the keys is refused, naming the ZeroConfig field and flag.
4. Non-deterministic reductions train the same model within rounding (docs say the bits
   hold only with deterministic ones).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from parity import ParityCase, train
from virtual_parity import train_virtual

import zero_core
from zero_comm import CollectiveMismatchError, Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core import ZeroConfig, read_deepspeed


def _engine(comm: Communicator, stage: int) -> zero_core.ZeroEngine:
    torch.manual_seed(0)
    return zero_core.initialize(
        torch.nn.Linear(3, 2), torch.optim.SGD,
        ZeroConfig(stage=stage, micro_batches_per_rank=(2, 1)), comm,
        optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip


def _mismatch(error: SimulatedRankError) -> CollectiveMismatchError:
    cause = error.__cause__
    assert isinstance(cause, CollectiveMismatchError), repr(cause)
    return cause


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_forgotten_slots_with_a_loss_print_fail_at_the_first_micro_step(stage: int) -> None:
    """Every rank: backward, step, all-reduce the loss for printing. Rank 0 (2 slots)
    holds its first slot's gradients and goes to the loss all-reduce; rank 1 sends its
    gradient rows: named there, in the first iteration, with the counts."""

    def body(comm: Communicator) -> None:
        engine = _engine(comm, stage)
        for _ in range(3):
            loss = engine(torch.randn(4, 3)).sum()
            engine.backward(loss)
            engine.step()
            comm.all_reduce(loss.detach().clone(), label="loss print")

    with pytest.raises(SimulatedRankError) as failed:
        run_simulated(2, body, timeout=20)
    message = str(_mismatch(failed.value))
    assert "micro_batches_per_rank=[2, 1]" in message
    assert "calls engine.backward c_i times per micro-step" in message
    assert "loss print" in message


@pytest.mark.timeout(120)
def test_forgotten_slots_without_another_collective_fail_at_the_end_naming_the_counts() -> None:
    """No collective but the engine's: rank 0 applies every other iteration (its two slots
    are two iterations), rank 1 every iteration, so after the same number of iterations
    rank 1 is a step ahead; its next gradient collective meets whatever rank 0 does next
    (here a barrier at the end of the run), named with the counts, not a hang."""
    applied: dict[int, list[bool]] = {}

    def body(comm: Communicator) -> None:
        engine = _engine(comm, 2)
        applied[comm.rank] = []
        for _ in range(4):
            engine.backward(engine(torch.randn(4, 3)).sum())
            applied[comm.rank].append(engine.step())
        comm.barrier()

    with pytest.raises(SimulatedRankError) as failed:
        run_simulated(2, body, timeout=20)
    assert "micro_batches_per_rank=[2, 1]" in str(_mismatch(failed.value))
    assert applied[0] == [False, True, False, True]
    assert applied[1][:2] == [True, True]  # then its third gradient collective meets the barrier


def test_a_homogeneous_run_labels_its_collectives_as_before() -> None:
    """The hint is only on row collectives (uneven counts): a homogeneous run's labels and
    bits are today's."""
    from zero_core.slot_rows import SlotRows
    from zero_core.virtual_ranks import VirtualRanks

    def body(comm: Communicator) -> tuple[str, str]:
        plain = SlotRows(VirtualRanks.homogeneous(2, comm.rank), comm).label_hint
        return plain, SlotRows(VirtualRanks((2, 1), comm.rank), comm).label_hint

    for plain, uneven in run_simulated(2, body):
        assert plain == ""
        assert uneven.startswith(" [micro_batches_per_rank=[2, 1]")


# ------------------------------------------------------------------ 2. Lightning, HF


# Needs Lightning / transformers: nox -s integrations installs them (pinned).
@pytest.mark.integrations
@pytest.mark.parametrize("counts", [(2, 1), (2, 2), "auto"])
def test_lightning_refuses_micro_batch_slots_every_way_they_are_given(counts: Any) -> None:
    pytest.importorskip("lightning.pytorch")
    from zero_core.lightning import ZeroStrategy

    fix = "Lightning gives every rank the same batches and one backward per batch"
    with pytest.raises(ValueError, match=fix):
        ZeroStrategy(stage=2, micro_batches_per_rank=counts)
    with pytest.raises(ValueError, match=fix):
        ZeroStrategy(config=ZeroConfig(stage=2, micro_batches_per_rank=counts))


# Needs Lightning / transformers: nox -s integrations installs them (pinned).
@pytest.mark.integrations
def test_lightning_keeps_shard_weights_and_all_ones_counts() -> None:
    pytest.importorskip("lightning.pytorch")
    from zero_core.lightning import ZeroStrategy

    strategy = ZeroStrategy(stage=3, shard_weights=(2, 1), micro_batches_per_rank=(1, 1))
    config = strategy.settings.resolve(
        world_size=2, precision="32-true", accumulate_grad_batches=2, gradient_clip_val=None
    )
    assert (config.shard_weights, config.micro_batches_per_rank) == ((2.0, 1.0), (1, 1))
    assert config.gradient_accumulation_steps == 2


# Needs Lightning / transformers: nox -s integrations installs them (pinned).
@pytest.mark.integrations
def test_lightning_refuses_the_keys_in_its_deepspeed_config() -> None:
    pytest.importorskip("lightning.pytorch")
    from zero_core.lightning import ZeroStrategy

    strategy = ZeroStrategy(deepspeed={"zero_optimization": {"micro_batches_per_rank": [2, 1]}})
    with pytest.raises(ValueError, match="--micro-batches-per-rank 2,1"):
        strategy.settings.resolve(
            world_size=2, precision="32-true", accumulate_grad_batches=1, gradient_clip_val=None
        )


# Needs Lightning / transformers: nox -s integrations installs them (pinned).
@pytest.mark.integrations
def test_the_hf_trainer_refuses_micro_batch_slots_and_keeps_shard_weights(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from zero_core.huggingface.trainer import _refuse_unsupported

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = torch.nn.Linear(3, 2)
    for counts in [(2, 1), "auto"]:
        with pytest.raises(ValueError, match="the Trainer gives every rank the same batches"):
            _refuse_unsupported(model, args, ZeroConfig(micro_batches_per_rank=counts), {}, None)
    _refuse_unsupported(model, args, ZeroConfig(shard_weights=(2, 1)), {}, None)
    _refuse_unsupported(model, args, ZeroConfig(micro_batches_per_rank=(1, 1)), {}, None)


# ------------------------------------------------------------------ 3. DeepSpeed configs


@pytest.mark.parametrize("name", ["micro_batches_per_rank", "shard_weights"])
@pytest.mark.parametrize("where", ["top", "zero_optimization"])
def test_a_deepspeed_config_refuses_the_zero_core_keys_naming_the_fix(
    name: str, where: str
) -> None:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {}}
    (config if where == "top" else config["zero_optimization"])[name] = [2, 1]
    path = name if where == "top" else f"zero_optimization.{name}"
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError) as refused:
        read_deepspeed(config, world_size=2)
    message = str(refused.value)
    assert f"{path!r} is zero_core's ZeroConfig field {name!r}" in message
    assert f"{flag} 2,1 (with --deepspeed too)" in message
    assert f"zero_core.ZeroConfig({name}=...)" in message


def test_the_deepspeed_facade_refuses_them_too() -> None:
    from zero_core import deepspeed

    def body(comm: Communicator) -> None:
        config = {"train_micro_batch_size_per_gpu": 1, "shard_weights": "auto"}
        with pytest.raises(ValueError, match="'shard_weights' is zero_core's ZeroConfig field"):
            deepspeed.initialize(
                model=torch.nn.Linear(3, 2), optimizer=torch.optim.SGD(
                    torch.nn.Linear(3, 2).parameters(), lr=0.1), config=config, comm=comm,
            )  # fmt: skip

    run_simulated(2, body)


# ------------------------------------------------------------------ 4. deterministic=False


@pytest.mark.timeout(300)
def test_non_deterministic_reductions_train_the_v_rank_model_within_rounding() -> None:
    """Without deterministic reductions the fold's order is not fixed, so the bits may
    differ from the V-rank run's (docs/mixed-hardware.md); the model is the same within
    float32 rounding. The engine says so when it is built, naming the fix."""
    case = ParityCase(widths=(5, 33, 7), accumulation=2, clip=0.05, bucket_numel=64, steps=3)
    reference = run_simulated(3, lambda comm: train(case, comm, 2))[0]
    with pytest.warns(UserWarning, match=r"deterministic=False.*deterministic=True") as told:
        got = run_simulated(
            2, lambda comm: train_virtual(case, comm, 2, (2, 1)), deterministic=False
        )
    assert len([w for w in told if "micro_batches_per_rank=[2, 1]" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # deterministic: nothing to say
        run_simulated(2, lambda comm: train_virtual(case, comm, 2, (2, 1)))
    for states in got:
        assert len(states) == len(reference) == case.steps
        for want, have in zip(reference, states, strict=True):
            for name, value in want.items():
                torch.testing.assert_close(have[name], value, rtol=1e-5, atol=1e-6)
