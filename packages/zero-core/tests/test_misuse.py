"""What users get wrong, named instead of silently mis-trained (found by review)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core import ZeroConfig


def engine_for(
    model: torch.nn.Module, comm: Communicator, stage: int = 2, **config: object
) -> zero_core.ZeroEngine:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return zero_core.initialize(model, optimizer, ZeroConfig(stage=stage, **config), comm)  # type: ignore[arg-type]


def test_a_gradient_arriving_after_its_bucket_was_reduced_is_an_error() -> None:
    """Reentrant checkpointing of a module used twice fires its gradient hook twice."""

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.a, x, use_reentrant=True, preserve_rng_state=False)
            return checkpoint(self.a, h, use_reentrant=True, preserve_rng_state=False)

    def body(comm: Communicator) -> None:
        engine = engine_for(Twice(), comm, bucket_numel=1)
        x = torch.ones(2, 6, requires_grad=True)
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            engine.backward(engine(x).sum())

    run_simulated(1, body)


@pytest.mark.parametrize("stage", [1, 2])
def test_replacing_parameter_data_after_initialize_is_named(stage: int) -> None:
    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(3, 2)
        engine = engine_for(model, comm, stage)
        model.weight.data = torch.zeros(2, 3)
        engine.backward(engine(torch.ones(1, 3)).sum())
        with pytest.raises(RuntimeError, match=r"parameter weight no longer uses"):
            engine.step()

    run_simulated(2, body)


def test_an_optimizer_not_known_to_be_elementwise_is_refused_unless_allowed() -> None:
    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(3, 2)
        with pytest.raises(TypeError, match="Adafactor is not a known elementwise"):
            zero_core.initialize(
                model, torch.optim.Adafactor(model.parameters()), ZeroConfig(), comm
            )
        zero_core.initialize(model, torch.optim.Adafactor(model.parameters()),
                             ZeroConfig(allow_untested_optimizer=True), comm)  # fmt: skip

    run_simulated(1, body)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_instead_of_engine_backward_is_named(stage: int) -> None:
    """Also at stages 0 and 1, whose gradients are views of the engine's buffers: there
    loss.backward() used to add into the views unseen, and step() skipped silently."""

    def body(comm: Communicator) -> None:
        engine = engine_for(torch.nn.Linear(3, 2), comm, stage=stage)
        for _ in range(2):  # before the first step, and after one
            with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
                engine(torch.ones(1, 3)).sum().backward()
                engine.step()
            engine.zero_grad()
            engine.backward(engine(torch.ones(1, 3)).sum())
            assert engine.step()

    run_simulated(1, body)


def test_loss_backward_at_stage_3_with_freed_parameters_is_named() -> None:
    """Stage 3 frees each module's parameters after forward: a plain loss.backward() used
    to fail inside autograd with 'setStorage: ... out of bounds for storage of size 0'."""

    def body(comm: Communicator) -> None:
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        engine = zero_core.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            ZeroConfig(stage=3, persistence_threshold=0), comm,
        )  # fmt: skip
        with pytest.raises(RuntimeError, match=r"at stage 3.*call engine.backward\(loss\)"):
            engine(torch.ones(2, 16)).sum().backward()
        engine.backward(engine(torch.ones(2, 16)).sum())  # the engine goes on
        assert engine.step()

    run_simulated(2, body)


def test_a_deleted_engine_is_not_kept_alive_by_its_hooks() -> None:
    model = torch.nn.Linear(3, 2)
    engine = run_simulated(1, lambda comm: engine_for(model, comm))[0]
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None


def test_deepspeed_defaults_that_mean_off_are_accepted() -> None:
    assert ZeroConfig.from_deepspeed({"gradient_clipping": 0.0}).clip_grad_norm is None
    config = ZeroConfig.from_deepspeed(
        {"bf16": {"enabled": True}, "fp16": {"enabled": False, "loss_scale": 128}}
    )
    assert config.param_dtype is torch.bfloat16 and config.loss_scale == 0.0


def test_an_empty_parameter_group_works_at_every_stage() -> None:
    def body(comm: Communicator) -> list[bool]:
        applied = []
        for stage in (0, 1, 2):
            model = torch.nn.Linear(3, 2)
            groups = [{"params": list(model.parameters())}, {"params": [], "lr": 0.01}]
            engine = zero_core.initialize(model, torch.optim.SGD(groups, lr=0.1),
                                          ZeroConfig(stage=stage), comm)  # fmt: skip
            engine.backward(engine(torch.ones(1, 3)).sum())
            applied.append(engine.step())
        return applied

    assert run_simulated(2, body)[0] == [True, True, True]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_without_backward_says_so_once(stage: int) -> None:
    """step() with no backward since the last step applied nothing and returned False
    without a word (found probing); now rank 0 warns, once per engine, and the second
    rank and the next such step stay quiet."""
    import warnings

    def body(comm: Communicator) -> list[bool]:
        engine = engine_for(torch.nn.Linear(3, 2), comm, stage=stage)
        applied = [engine.step(), engine.step()]
        engine.backward(engine(torch.ones(1, 3)).sum())
        return [*applied, engine.step()]

    with warnings.catch_warnings(record=True) as caught:  # ranks are threads: one record
        warnings.simplefilter("always")
        assert run_simulated(2, body) == [[False, False, True]] * 2
    said = [
        w for w in caught if "with no engine.backward(loss) since the last step" in str(w.message)
    ]
    assert len(said) == 1
