"""ZeroStrategy's settings, checked in one process (no ranks): what is refused, by name,
before any process starts, and how the Trainer's settings reach the ZeroConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")
import lightning as L
import torch

from zero_core import ZeroConfig
from zero_core.lightning import ZeroStrategy

pytestmark = pytest.mark.integrations


def _resolve(strategy: ZeroStrategy, precision: str = "32-true", accumulate: int = 1,
             clip: float | None = None) -> ZeroConfig:  # fmt: skip
    return strategy.settings.resolve(
        world_size=2, precision=precision, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )  # fmt: skip


def test_three_ways_to_give_the_settings(tmp_path: Path) -> None:
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}))
    by_fields = _resolve(ZeroStrategy(stage=3, bucket_numel=2**10))
    assert (by_fields.stage, by_fields.bucket_numel) == (3, 2**10)
    assert _resolve(ZeroStrategy(config=ZeroConfig(stage=1))).stage == 1
    from_ds = _resolve(ZeroStrategy(deepspeed=str(ds)))
    assert (from_ds.stage, from_ds.clip_grad_norm) == (3, 1.0)


def test_settings_given_two_ways_or_misspelt_are_refused() -> None:
    with pytest.raises(ValueError, match="config= and deepspeed="):
        ZeroStrategy(config=ZeroConfig(stage=1), deepspeed={"zero_optimization": {"stage": 1}})
    with pytest.raises(TypeError, match="stag: not ZeroConfig fields"):
        ZeroStrategy(stag=3)
    with pytest.raises(ValueError, match="'optimizer' section"):
        _resolve(ZeroStrategy(deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1}}}))


def test_the_trainers_precision_accumulation_and_clipping() -> None:
    config = _resolve(ZeroStrategy(stage=2), precision="bf16-mixed", accumulate=4)
    assert (config.param_dtype, config.gradient_accumulation_steps) == (torch.bfloat16, 4)
    assert _resolve(ZeroStrategy(), precision="16-mixed").param_dtype is torch.float16
    with pytest.raises(ValueError, match=r"precision=.16-mixed..*param_dtype=torch\.bfloat16"):
        _resolve(ZeroStrategy(param_dtype="bf16"), precision="16-mixed")
    with pytest.raises(ValueError, match="accumulate_grad_batches=2"):
        _resolve(ZeroStrategy(gradient_accumulation_steps=4), accumulate=2)
    with pytest.raises(ValueError, match=r"gradient_clip_val=1\.0.*clip_grad_norm=0\.5"):
        _resolve(ZeroStrategy(clip_grad_norm=0.5), clip=1.0)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_a_precision_the_engine_cannot_honour_stops_the_trainer(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision={precision!r}.*Supported: '32-true'"):
        L.Trainer(accelerator="cpu", devices=2, precision=precision, strategy=ZeroStrategy())


def test_sync_batchnorm_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="sync_batchnorm=True"):
        L.Trainer(accelerator="cpu", devices=2, sync_batchnorm=True, strategy=ZeroStrategy())


def test_the_registered_names() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zero_stage_3", logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.settings.fields == {"stage": 3}
    mixed = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(), logger=False,
                      precision="bf16-mixed")  # fmt: skip
    assert mixed.strategy.precision_plugin.precision == "bf16-mixed"
