"""zero_core.deepspeed: DeepSpeed's API over the engine, on simulated ranks.

Each DeepSpeed habit either does what DeepSpeed does (checked against the core engine's
own answer: full_state_dict, stage 0) or raises naming the missing feature. Models are
built once, outside the rank threads (simulated ranks share torch's global RNG), and
copied into each rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_core
import zero_core.deepspeed as deepspeed
from zero_comm import Communicator, run_simulated
from zero_core.deepspeed import UnsupportedFeatureError, utils
from zero_core.deepspeed.accelerator import get_accelerator
from zero_core.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

torch.manual_seed(0)
MODEL = nn.Sequential(nn.Linear(7, 15), nn.ReLU(), nn.Linear(15, 3))  # awkward shapes: padding
DATA = [(torch.randn(7), torch.randn(3)) for _ in range(16)]


def config(stage: int, dtype: str = "fp32", **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": dtype == "bf16"},
        # Every parameter partitioned at stage 3 (none kept whole as "persistent").
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def start(comm: Communicator, stage: int, dtype: str = "fp32", **kwargs: Any) -> Any:
    model = copy.deepcopy(MODEL)
    kwargs.setdefault("config", config(stage, dtype))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), comm=comm,
                                training_data=DATA, **kwargs)  # fmt: skip


def train(engine: Any, loader: Any) -> list[float]:
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_initialize_returns_the_four_tuple_and_the_engine_answers_deepspeeds_queries() -> None:
    def body(comm: Communicator) -> None:
        engine, optimizer, loader, scheduler = start(comm, 2)
        assert isinstance(engine, nn.Module) and isinstance(engine, deepspeed.DeepSpeedEngine)
        assert optimizer is engine.optimizer is engine.core.optimizer
        assert scheduler is None and engine.lr_scheduler is None
        assert isinstance(loader, torch.utils.data.DataLoader)
        assert list(engine.parameters()) == list(engine.module.parameters())
        assert engine.train_micro_batch_size_per_gpu() == 2
        assert engine.gradient_accumulation_steps() == 2
        assert engine.train_batch_size() == 2 * 2 * 2
        assert engine.zero_optimization_stage() == 2
        assert engine.get_lr() == [1e-2]
        assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert (engine.global_rank, engine.world_size, engine.local_rank) == (comm.rank, 2, 0)
        assert engine.device == torch.device("cpu")
        assert engine.eval() is engine and not engine.module.training
        assert engine.train() is engine and engine.module.training
        engine.module.custom = "kept"  # unknown attributes reach the module
        assert engine.custom == "kept"
        with pytest.raises(AttributeError, match="neither the DeepSpeed engine nor its module"):
            engine.no_such_thing  # noqa: B018
        boundaries = []
        for x, y in loader:
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(nn.functional.mse_loss(engine(x), y))
            if not engine.is_gradient_accumulation_boundary():
                with pytest.raises(RuntimeError, match="would drop their gradients"):
                    engine.zero_grad()
            engine.step()
            if engine.core.micro_steps == 0:
                engine.zero_grad()  # after an applied step: nothing to drop
        assert boundaries == [False, True] * 2
        assert engine.global_steps == 2 and engine.was_step_applied()

    run_simulated(2, body)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_stage_gives_the_same_losses_as_stage_0(dtype: str) -> None:
    """Deterministic reductions: the facade's losses are equal, bit for bit, at every stage."""
    losses = [run_simulated(2, lambda comm, s=s: train(*start(comm, s, dtype)[:3:2]))[0]
              for s in range(4)]  # fmt: skip
    assert losses[1:] == [losses[0]] * 3
    assert len(losses[0]) == 4


def test_deepspeed_chats_zero3_export_takes_its_zero3_path_and_exports_the_weights() -> None:
    """DeepSpeed-Chat's save_zero_three_model, unchanged but for its import: the stage-3
    parameters carry ds_id and are NOT_AVAILABLE, so it gathers each one; the exported
    values are whole, finite and equal to the engine's own full state dict."""

    def export(model: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in model.named_parameters():
            if hasattr(v, "ds_id"):
                fetch = [p for p in [v] if hasattr(p, "ds_id")
                         and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]  # fmt: skip
                with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                    assert v.ds_status == ZeroParamStatus.AVAILABLE
                    v_p = v.data.cpu()
                assert v.ds_status == ZeroParamStatus.NOT_AVAILABLE
            else:
                v_p = v.cpu()
            out[k] = v_p
        return out

    def body(comm: Communicator, stage: int, dtype: str) -> bool:
        engine, _, loader, _ = start(comm, stage, dtype)
        train(engine, loader)
        p = engine.module[0].weight
        marked = hasattr(p, "ds_id")
        if marked:
            assert (p.ds_numel, p.ds_shape) == (105, torch.Size([15, 7]))
        exported = export(engine.module)
        full = engine.core.full_state_dict()
        for name, value in exported.items():
            assert torch.isfinite(value).all(), name
            assert torch.equal(value, full[name].to(value.dtype)), name
        return marked

    for stage, dtype in [(3, "fp32"), (3, "bf16"), (2, "fp32")]:
        marked = run_simulated(2, lambda comm, s=stage, d=dtype: body(comm, s, d))
        assert marked == [stage == 3] * 2


def test_only_the_facade_marks_parameters() -> None:
    """Plain zero_core.initialize adds no ds_* attribute (PEFT and transformers would take
    the parameter for real DeepSpeed's)."""

    def body(comm: Communicator) -> bool:
        model = copy.deepcopy(MODEL)
        zero_core.initialize(model, torch.optim.AdamW, zero_core.ZeroConfig(stage=3), comm)
        return any(hasattr(p, m) for p in model.parameters() for m in ("ds_id", "ds_numel"))

    assert run_simulated(2, body) == [False, False]


def test_gathered_parameters_with_a_modifier_rank_changes_every_rank_at_stage_2() -> None:
    """DeepSpeed's block does nothing at stages 0-2 (rank 0's edit stays on rank 0); here
    the edit reaches every rank and the master weights."""

    def body(comm: Communicator) -> list[float]:
        engine, *_ = start(comm, 2)
        weight = engine.module[2].bias
        with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
            if comm.rank == 0:
                weight.data.fill_(0.5)
        return utils.safe_get_full_fp32_param(weight).tolist()

    assert run_simulated(2, body) == [[0.5] * 3] * 2


def test_safe_get_full_values_equal_stage_0s_at_every_stage() -> None:
    """The fp32 parameter, gradient (between backward and step; None after) and Adam
    state of one parameter: the same bits at every stage."""

    def body(comm: Communicator, stage: int) -> list[Any]:
        engine, _, loader, _ = start(comm, stage)
        p = engine.module[0].weight
        assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None  # no step yet
        grads = []
        for x, y in loader:
            engine.backward(nn.functional.mse_loss(engine(x), y))
            grads.append(utils.safe_get_full_grad(p))
            engine.step()
            if engine.core.micro_steps == 0:  # applied: no gradient until the next backward
                assert utils.safe_get_full_grad(p) is None
        master = utils.safe_get_full_fp32_param(p)
        assert torch.equal(master, engine.core.full_state_dict()["0.weight"])
        with pytest.raises(KeyError, match="exp_avg_sq"):
            utils.safe_get_full_optimizer_state(p, "momentum_buffer")
        assert utils.safe_get_full_fp32_param(nn.Parameter(torch.ones(2))) is None
        return [master, utils.safe_get_full_optimizer_state(p, "exp_avg"), *grads]

    results = [run_simulated(2, lambda comm, s=s: body(comm, s))[1] for s in range(4)]
    assert all(g is not None and g.abs().sum() > 0 for g in results[0][2:])
    for stage in (1, 2, 3):
        for mine, reference in zip(results[stage], results[0], strict=True):
            assert torch.equal(mine, reference), stage


def test_the_dataloader_gives_each_rank_its_own_half() -> None:
    ids = list(range(12))

    def body(comm: Communicator) -> list[int]:
        model = copy.deepcopy(MODEL)
        _, _, loader, _ = deepspeed.initialize(
            model=model, config=config(0), comm=comm, training_data=ids,
            collate_fn=lambda batch: torch.tensor(batch),
        )  # fmt: skip
        batches = list(loader)
        assert all(len(b) == 2 for b in batches)  # train_micro_batch_size_per_gpu
        return [int(i) for b in batches for i in b]

    halves = run_simulated(2, body)
    assert len(halves[0]) == len(halves[1]) == 6
    assert not set(halves[0]) & set(halves[1]) and set(halves[0]) | set(halves[1]) == set(ids)


def test_a_scheduler_is_stepped_after_every_applied_step() -> None:
    def body(comm: Communicator) -> list[float]:
        engine, optimizer, loader, scheduler = start(
            comm, 1, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        )
        assert scheduler is engine.lr_scheduler and scheduler.optimizer is optimizer
        train(engine, loader)
        return engine.get_lr()

    assert run_simulated(2, body) == [[1e-2 / 4]] * 2  # two applied steps


def test_a_scheduler_that_would_not_drive_the_engine_is_refused() -> None:
    def body(comm: Communicator) -> None:
        other = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
        with pytest.raises(ValueError, match="built on another optimizer"):
            start(comm, 0, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
        with_section = config(0, scheduler={"type": "WarmupLR", "params": {}})
        with pytest.raises(ValueError, match="'scheduler' section"):
            start(comm, 0, config=with_section, lr_scheduler=lambda opt: None)

    run_simulated(1, body)


def test_unsupported_features_raise_naming_themselves() -> None:
    def body(comm: Communicator) -> None:
        def refused(match: str) -> Any:
            return pytest.raises(UnsupportedFeatureError, match=match)

        with refused("mpu"):
            start(comm, 0, mpu=object())
        with refused("pipeline engine"):
            start(comm, 0, config=config(0, pipeline={"stages": 2}))
        with refused("hybrid"):
            start(comm, 0, config=config(0, hybrid_engine={"enabled": True}))
        with warnings.catch_warnings(record=True) as seen:  # switched off: accepted
            warnings.simplefilter("always")
            engine, *_ = start(comm, 0, config=config(0, hybrid_engine={"enabled": False}))
        assert any("hybrid_engine: switched off" in str(w.message) for w in seen)
        x = DATA[0][0]
        with refused("retain_graph"):
            engine.backward(engine(x).sum(), retain_graph=True)
        with refused("lr_kwargs"):
            engine.step(lr_kwargs={"x": 1})
        with refused("save_latest"):
            engine.save_checkpoint("unused", save_latest=False)
        with refused("load_module_only"):
            engine.load_checkpoint("unused", load_module_only=True)
        with refused("fwd_module"):
            deepspeed.zero.GatheredParameters([], fwd_module=nn.Linear(1, 1))
        with refused("remote_device"):
            deepspeed.zero.Init(remote_device="cpu")
        with refused("dtype"):
            deepspeed.zero.Init(dtype=torch.bfloat16)
        with refused("rank"):
            deepspeed.init_distributed(rank=3)

    run_simulated(1, body)
    with pytest.raises(UnsupportedFeatureError, match="mixture of experts"):
        from zero_core.deepspeed.moe.layer import MoE  # noqa: F401
    with pytest.raises(UnsupportedFeatureError, match="pipeline parallelism"):
        from zero_core.deepspeed.pipe import PipelineModule  # noqa: F401
    with pytest.raises(UnsupportedFeatureError, match="compiled kernels"):
        deepspeed.ops.transformer  # noqa: B018
    with pytest.raises(UnsupportedFeatureError, match=r"zero_core\.deepspeed\.checkpointing"):
        deepspeed.checkpointing  # noqa: B018
    with pytest.raises(UnsupportedFeatureError, match="bias_correction"):
        deepspeed.ops.adam.FusedAdam([nn.Parameter(torch.ones(1))], bias_correction=False)


def test_fused_adam_is_torchs_adamw() -> None:
    from zero_core.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [nn.Parameter(torch.ones(1))]
    assert type(FusedAdam(params, lr=0.1)) is torch.optim.AdamW
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params, weight_decay=0.1)) is torch.optim.AdamW


def test_a_model_built_in_zero_init_trains_as_one_built_outside() -> None:
    def fixed(comm: Communicator) -> list[float]:
        with deepspeed.zero.Init(config_dict_or_path=config(3)):
            model = copy.deepcopy(MODEL)
        engine, _, loader, _ = deepspeed.initialize(model=model, config=config(3), comm=comm,
                                                    training_data=DATA)  # fmt: skip
        return train(engine, loader)

    outside = run_simulated(2, lambda comm: train(*start(comm, 3)[:3:2]))
    assert run_simulated(2, fixed) == outside


@pytest.mark.filterwarnings("ignore:load_checkpoint")
def test_save_and_load_checkpoint_round_trip_the_state_and_client_state(tmp_path: Path) -> None:
    client = {"epoch": 3, "pair": (1, 2.5), "nested": {"rng": torch.get_rng_state()[:8]},
              "t": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "none": None}  # fmt: skip
    (tmp_path / "hparams.json").write_text("{}")

    def body(comm: Communicator) -> None:
        engine, _, loader, _ = start(comm, 3)
        assert engine.load_checkpoint(tmp_path) == (None, None)  # nothing saved yet
        train(engine, loader)
        with pytest.raises(TypeError, match=r"client_state\['bad'\] is a builtins.object"):
            engine.save_checkpoint(tmp_path, client_state={"bad": object()})
        assert engine.save_checkpoint(tmp_path, client_state=client)
        saved = engine.core.full_state_dict()
        train(engine, loader)
        path, state = engine.load_checkpoint(tmp_path)
        assert path == str(tmp_path / "global_step2")
        assert state.keys() == client.keys() and state["pair"] == (1, 2.5)
        assert torch.equal(state["t"], client["t"]) and state["t"].dtype == torch.bfloat16
        assert torch.equal(state["nested"]["rng"], client["nested"]["rng"])
        after = engine.core.full_state_dict()
        assert all(torch.equal(after[k], saved[k]) for k in saved)
        loaded = utils.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    run_simulated(2, body)
    assert (tmp_path / "hparams.json").read_text() == "{}"
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    utils.convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "model.bin")
    assert set(torch.load(tmp_path / "model.bin")) == set(MODEL.state_dict())


def test_the_config_comes_from_args_deepspeed_config(tmp_path: Path) -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    assert "--local_rank" not in parser.format_help()  # DeepSpeed's adds none either
    (tmp_path / "ds.json").write_text(json.dumps(config(1)))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])

    def body(comm: Communicator) -> int:
        engine, *_ = deepspeed.initialize(args=args, model=copy.deepcopy(MODEL), comm=comm)
        with pytest.raises(ValueError, match="pass one of them"):
            deepspeed.initialize(args=args, model=copy.deepcopy(MODEL), comm=comm,
                                 config=config(1))  # fmt: skip
        return engine.zero_optimization_stage()

    assert run_simulated(1, body) == [1]


def test_the_accelerator_is_the_cpu_here() -> None:
    accelerator = get_accelerator()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the accelerator is CUDA's")
    assert accelerator.device_name() == accelerator.current_device_name() == "cpu"
    assert accelerator.device_name(1) == "cpu"
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.is_available() and accelerator.device_count() >= 1
    assert accelerator.current_device() == 0
    assert accelerator.is_bf16_supported() and accelerator.is_fp16_supported()
    accelerator.set_device(0)
    accelerator.synchronize()
    accelerator.empty_cache()
    accelerator.manual_seed(5)
    assert torch.initial_seed() == 5
    assert accelerator.memory_allocated() > 0
    with pytest.raises(UnsupportedFeatureError, match=r"get_accelerator\(\)\.Stream"):
        accelerator.Stream  # noqa: B018
