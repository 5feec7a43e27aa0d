"""Real DeepSpeed configs: the shapes in DeepSpeed's docs and Hugging Face's zero2/zero3
examples are read whole; what cannot be honoured is an error naming the key."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core.config.deepspeed_json import WarmupSchedule

# Hugging Face's examples (docs/source/en/deepspeed.md), "auto" included.
HF_ZERO2: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none"},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3: dict[str, Any] = {
    **HF_ZERO2,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
TRAINER = {  # what a trainer resolves "auto" with
    "bf16.enabled": True,
    "fp16.enabled": False,
    "optimizer.params.lr": 3e-4,
    "optimizer.params.betas": [0.9, 0.95],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.1,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 3e-4,
    "scheduler.params.warmup_num_steps": 10,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 32,
}
DOCS_ADAM = {  # DeepSpeed's getting-started config
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}


@pytest.mark.parametrize("config", [HF_ZERO2, HF_ZERO3], ids=["hf-zero2", "hf-zero3"])
def test_hugging_face_examples_resolve_with_the_trainers_settings(config: dict[str, Any]) -> None:
    setup = zero_core.read_deepspeed(config, world_size=4, auto=TRAINER)
    assert setup.zero.stage == config["zero_optimization"]["stage"]
    assert setup.zero.param_dtype is torch.bfloat16
    assert (setup.micro_batch_size, setup.train_batch_size) == (4, 32)
    assert setup.zero.gradient_accumulation_steps == 2 and setup.zero.clip_grad_norm == 1.0
    assert setup.optimizer == (
        torch.optim.AdamW,
        {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    )
    assert setup.scheduler == (
        "WarmupLR",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10},
    )
    assert setup.zero.overlap_comm is True
    assert any("contiguous_gradients" in note for note in setup.no_effect)
    assert any("steps_per_print" in note for note in setup.no_effect)
    if config is HF_ZERO3:
        assert setup.zero.keep_backward_head is True
        assert setup.zero.backward_head_numel == 10**9


@pytest.mark.parametrize(
    ("distance", "keep", "head"),
    [(0, False, zero_core.ZeroConfig.backward_head_numel), (0.0, False, 2**24), (1, True, 1),
     (5e8, True, 5 * 10**8), ("auto", True, 2**24)],
)  # fmt: skip
def test_reuse_distance_bounds_the_units_kept_for_backward(
    distance: float | str, keep: bool, head: int
) -> None:
    config = {**HF_ZERO3, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": distance}}
    setup = zero_core.read_deepspeed(config, world_size=4, auto=TRAINER)
    assert (setup.zero.keep_backward_head, setup.zero.backward_head_numel) == (keep, head)


@pytest.mark.parametrize("distance", [-1, "far", True, None])
def test_reuse_distance_that_is_not_a_distance_is_an_error(distance: object) -> None:
    config = {**HF_ZERO3, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": distance}}
    with pytest.raises(ValueError, match=r"stage3_max_reuse_distance=.* must be a number >= 0"):
        zero_core.read_deepspeed(config, world_size=4, auto=TRAINER)


def test_a_json_file_reads_like_the_dict(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DOCS_ADAM, "zero_optimization": {"stage": 1}}))
    setup = zero_core.read_deepspeed(path, world_size=2)
    assert (setup.micro_batch_size, setup.zero.gradient_accumulation_steps) == (4, 1)
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    assert setup.optimizer is not None and setup.optimizer[0] is torch.optim.AdamW
    plain = {
        **DOCS_ADAM,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
    }
    assert zero_core.read_deepspeed(plain, world_size=2).optimizer == (
        torch.optim.Adam,
        {"lr": 1e-3},
    )


@pytest.mark.parametrize(
    ("batch", "world_size", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (4, 32, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (4, 32, 4)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 3, (3, 18, 2)),
        ({"train_batch_size": 12}, 3, (4, 12, 1)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 3,
            },
            4,
            (2, 24, 3),
        ),
    ],
)
def test_two_batch_sizes_determine_the_third(
    batch: dict[str, int], world_size: int, expected: tuple[int, int, int]
) -> None:
    setup = zero_core.read_deepspeed(batch, world_size=world_size)
    assert (
        setup.micro_batch_size,
        setup.train_batch_size,
        setup.zero.gradient_accumulation_steps,
    ) == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {
                "train_batch_size": 30,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            r"train_batch_size=30 is not 4 x 2 x 4 = 32",
        ),
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            "does not divide into 4 x 4 ranks",
        ),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "type 'Lamb' is not supported"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}},
            "optimizer.params.momentum is not a parameter of AdamW",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
            "optimizer.params.lr is 'auto' and nothing resolved it",
        ),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler type 'OneCycle'"),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}},
            "needs params.total_num_steps",
        ),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled is 'auto' and nothing resolved it"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "x": 1}}},
            "offload_param.x is not supported",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "cpu_offload": True,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                }
            },
            r"cpu_offload=true \(DeepSpeed's deprecated offload_optimizer.*contradicts",
        ),
        ({"amp": {"enabled": True}}, "amp.enabled=True: NVIDIA Apex AMP is not supported"),
    ],
)
def test_what_cannot_be_honoured_is_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zero_core.read_deepspeed(config, world_size=4)


def test_the_engine_config_alone_refuses_the_trainers_keys() -> None:
    with pytest.raises(ValueError, match="'optimizer' configures the training loop"):
        zero_core.ZeroConfig.from_deepspeed({"optimizer": {"type": "SGD"}})


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_schedules_follow_deepspeeds_formulas(kind: str) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    params = {
        "WarmupLR": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 8},
        "WarmupDecayLR": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 4,
            "total_num_steps": 12,
            "warmup_type": "linear",
        },
        "WarmupCosineLR": {
            "warmup_num_steps": 4,
            "total_num_steps": 12,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
        },
    }[kind]
    schedule = WarmupSchedule(optimizer, kind, **params)
    seen = []
    for _ in range(14):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    w = params["warmup_num_steps"]
    # DeepSpeed's scheduler starts at iteration -1 (the minimum) and steps after each
    # update: update u runs at iteration k = u - 1 (real DeepSpeed agrees: nox -s deepspeed)
    assert seen[0] == (0.5 * 0.0 if kind == "WarmupCosineLR" else params["warmup_min_lr"])
    for u, lr in enumerate(seen[1:], start=1):
        k = u - 1
        if kind == "WarmupLR":
            gamma = math.log(k + 1) / math.log(w) if k < w else 1.0
            expected = 0.01 + 0.09 * gamma
        elif kind == "WarmupDecayLR":
            expected = 0.1 * (k / w if k < w else max(0.0, (12 - k) / (12 - w)))
        else:
            ratio = (
                0.1 + 0.9 * math.log(k + 1) / math.log(w)
                if k < w
                else max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * (k - w + 1) / (12 - w))) / 2)
            )
            expected = 0.5 * ratio
        assert lr == pytest.approx(expected, rel=1e-12, abs=1e-15), (k, lr, expected)


def test_initialize_builds_the_optimizer_and_scheduler_from_the_config(tmp_path: Path) -> None:
    """deepspeed.initialize's form: the config alone gives the optimizer (AdamW with its
    options) and a scheduler that every applied step advances; the scheduler resumes
    from a checkpoint; accepted keys without effect are listed in one warning."""
    config = {**HF_ZERO3, "bf16": {"enabled": False}, "fp16": {"enabled": False}}

    def body(comm: Communicator) -> tuple[list[float], list[float], int]:
        torch.manual_seed(0)
        auto = {k: v for k, v in TRAINER.items() if k != "train_batch_size"}  # computed
        setup = zero_core.read_deepspeed(config, world_size=comm.world_size, auto=auto)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        engine = zero_core.initialize(model, config=setup, comm=comm)
        assert isinstance(engine.optimizer, torch.optim.AdamW)
        assert engine.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
        lrs = []
        for step in range(4):
            for _ in range(2):  # gradient_accumulation_steps = 2
                engine.backward(engine(torch.ones(3, 4) * (step + 1)).square().mean())
                engine.step()
            lrs.append(engine.optimizer.param_groups[0]["lr"])
            if step == 1:
                engine.save(tmp_path / "ckpt")
        resumed = zero_core.initialize(
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
            config=setup,
            comm=comm,
        )
        resumed.load(tmp_path / "ckpt")
        again = [resumed.optimizer.param_groups[0]["lr"]]
        return lrs, again, resumed.lr_scheduler.last_epoch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrs, again, epoch = run_simulated(1, body)[0]
    # after update u the next runs at iteration u - 1 (DeepSpeed's WarmupLR starts at -1)
    assert lrs == pytest.approx([3e-4 * math.log(k + 1) / math.log(10) for k in (0, 1, 2, 3)])
    assert again == [lrs[1]] and epoch == 2
    notes = [str(w.message) for w in caught if "without effect" in str(w.message)]
    assert len(notes) == 2 and "contiguous_gradients" in notes[0]  # one per initialize


def test_an_optimizer_in_both_places_is_refused() -> None:
    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(2, 2)
        zero_core.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
            comm,
        )

    with pytest.raises(Exception, match="use one of them"):
        run_simulated(1, body)


@pytest.mark.parametrize("enabled", [True, False, "auto"])
def test_the_older_bfloat16_spelling_is_read_as_bf16(enabled: bool | str) -> None:
    """DeepSpeed reads ``"bfloat16": {"enabled": true}`` as its bf16 section; refusing it
    made users delete it and train in float32 without a word."""
    for auto in ({"bf16.enabled": True}, {"bf16.enabled": False}):
        old = zero_core.read_deepspeed({"bfloat16": {"enabled": enabled}}, world_size=2, auto=auto)
        new = zero_core.read_deepspeed({"bf16": {"enabled": enabled}}, world_size=2, auto=auto)
        assert old.zero == new.zero
        expected = enabled if enabled != "auto" else auto["bf16.enabled"]
        assert (old.zero.param_dtype == torch.bfloat16) is expected
    with pytest.raises(ValueError, match=r"both 'bfloat16' and 'bf16'.*keep 'bf16'"):
        zero_core.read_deepspeed(
            {"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, world_size=2
        )
