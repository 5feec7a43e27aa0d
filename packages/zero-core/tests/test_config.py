"""ZeroConfig validation, the DeepSpeed dict, and the errors initialize raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_core
from zero_comm import run_simulated
from zero_core import ZeroConfig
from zero_core.config.deepspeed_translation import translate_deepspeed


def test_defaults_and_dtype_names() -> None:
    assert ZeroConfig().stage == 2
    assert ZeroConfig(param_dtype="bf16").param_dtype is torch.bfloat16
    assert ZeroConfig(param_dtype=torch.float16).param_dtype is torch.float16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "stage=4"),
        ({"param_dtype": "int8"}, "param_dtype='int8'"),
        ({"bucket_numel": 0}, "bucket_numel=0"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan"),
        ({"loss_scale": 128.0}, "float16 only"),
        ({"param_dtype": "fp16", "initial_loss_scale": 0.5}, "min_loss_scale"),
        ({"overlap_comm": "false"}, "overlap_comm='false' must be True or False"),
        ({"release_host_heap": 1}, "release_host_heap=1 must be True or False"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ZeroConfig(**kwargs)  # type: ignore[arg-type]


def test_deepspeed_dict() -> None:
    config = ZeroConfig.from_deepspeed(
        {
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e5},
            "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100},
            "gradient_accumulation_steps": 4,
            "gradient_clipping": 1.0,
        }
    )
    assert (config.stage, config.bucket_numel, config.param_dtype) == (1, 500_000, torch.float16)
    assert (config.initial_loss_scale, config.loss_scale_window) == (4096.0, 100)
    assert (config.gradient_accumulation_steps, config.clip_grad_norm) == (4, 1.0)
    assert ZeroConfig.from_deepspeed({"bf16": {"enabled": True}}).param_dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_batch_size": 8}, "'train_batch_size' configures the training loop"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device='gpu'",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_pth": "/x"}}},
            "zero_optimization.offload_optimizer.nvme_pth is not supported",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "offload_params='cpu' needs stage=3",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "needs offload_dir",
        ),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enable one of them"),
    ],
)
def test_deepspeed_keys_we_do_not_support_are_rejected_by_name(config: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        ZeroConfig.from_deepspeed(config)


def test_deepspeed_overlap_comm_maps_to_the_config_and_is_noted_where_it_does_nothing() -> None:
    assert ZeroConfig().overlap_comm is True
    for stage in (0, 1):
        zero = {"stage": stage, "overlap_comm": False}
        fields, notes = translate_deepspeed({"zero_optimization": zero})
        assert fields == zero and not any("overlap_comm" in note for note in notes)
        assert ZeroConfig.from_deepspeed({"zero_optimization": zero}).overlap_comm is False
    for stage in (2, 3):
        _, notes = translate_deepspeed(
            {"zero_optimization": {"stage": stage, "overlap_comm": False}}
        )
        assert any("overlap_comm=false: no effect at stages 2 and 3" in n for n in notes)
    _, notes = translate_deepspeed({"zero_optimization": {"overlap_comm": True}})
    assert not any("overlap_comm" in note for note in notes)


def test_deepspeed_stage_3_keys_map_to_the_config() -> None:
    config = ZeroConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
        "stage3_param_persistence_threshold": 1e5}})  # fmt: skip
    assert (config.stage, config.prefetch_numel, config.max_live_numel) == (3, 5 * 10**7, 10**9)
    assert config.persistence_threshold == 10**5
    with pytest.raises(ValueError, match="prefetch_numel=-1 must be an integer >= 0"):
        ZeroConfig(prefetch_numel=-1)


def test_optimizer_forms_and_their_errors() -> None:
    def body(comm: object) -> None:
        model = torch.nn.Linear(3, 2)
        config = ZeroConfig(stage=2)
        engine = zero_core.initialize(model, torch.optim.Adam, config, comm,  # type: ignore[arg-type]
                                      optimizer_kwargs={"lr": 0.1})  # fmt: skip
        assert isinstance(engine.optimizer, torch.optim.Adam)
        model = torch.nn.Linear(3, 2)
        engine = zero_core.initialize(
            model,
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            config,
            comm,  # type: ignore[arg-type]
        )
        assert isinstance(engine.optimizer, torch.optim.SGD)
        other = torch.nn.Linear(3, 2)
        model = torch.nn.Linear(3, 2)
        with pytest.raises(ValueError, match="not in the model"):
            zero_core.initialize(model, torch.optim.SGD(other.parameters(), lr=0.1), config, comm)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"trainable parameters \['bias'\] are in no"):
            zero_core.initialize(model, torch.optim.SGD([model.weight], lr=0.1), config, comm)  # type: ignore[arg-type]

    run_simulated(2, body)  # type: ignore[arg-type]


def test_backward_twice_without_step_is_named() -> None:
    def body(comm: object) -> None:
        model = torch.nn.Linear(3, 2)
        engine = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      ZeroConfig(stage=2), comm)  # type: ignore[arg-type]  # fmt: skip
        engine.backward(engine(torch.ones(1, 3)).sum())
        with pytest.raises(RuntimeError, match="without step"):
            engine.backward(engine(torch.ones(1, 3)).sum())

    run_simulated(1, body)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_full_state_dict_on_one_rank(stage: int) -> None:
    def body(comm: object) -> list[str]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        config = ZeroConfig(stage=stage, param_dtype="bf16")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zero_core.initialize(model, optimizer, config, comm)  # type: ignore[arg-type]
        state = engine.full_state_dict(rank=1)
        assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
        return sorted(state)

    everyone = run_simulated(3, body)  # type: ignore[arg-type]
    assert everyone[0] == everyone[2] == []
    plain = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    assert everyone[1] == sorted(plain.state_dict())


def test_deepspeed_offload_sections_map_to_the_tiers(tmp_path: Path) -> None:
    config = ZeroConfig.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 1e6,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.3,
                                      "buffer_count": 5, "pin_memory": False, "fast_init": False},
                "offload_param": {"device": "cpu", "max_in_cpu": 1e9},
            },
            "aio": {"thread_count": 2, "block_size": 1048576, "queue_depth": 8},
        }
    )  # fmt: skip
    assert (config.offload_optimizer, config.offload_params) == ("disk", "cpu")
    assert config.offload_dir == str(tmp_path) and config.offload_fraction == 0.3
    assert config.offload_sub_group_numel == 10**6 and config.offload_buffer_count == 5
    assert config.offload_io_threads == 2 and config.offload_pin_memory is False


def test_two_different_nvme_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="give both the same path"):
        ZeroConfig.from_deepspeed(
            {"zero_optimization": {"stage": 3,
                                   "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                   "offload_param": {"device": "nvme", "nvme_path": "/b"}}}
        )  # fmt: skip
