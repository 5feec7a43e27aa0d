"""Tiny Lightning fits on 2 CPU ranks, one after another in the same processes: under
Lightning's own launcher (``python lightning_runs.py OUT``: rank 0 re-runs this script as
rank 1) or under torchrun. Each run's final float32 parameters and per-step losses go to
``OUT/<run>.pt`` (rank 0); test_lightning_strategy.py compares them.

Every run starts from the same seed, data and learning-rate schedule; the model has
awkward shapes (7 -> 15 -> 3) so the flat buffers are padded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_core.lightning import ZeroStrategy

SAMPLES, BATCH = 32, 4  # 4 batches per rank per epoch on 2 ranks


class TinyRegression(L.LightningModule):
    """A 2-layer MLP; AdamW (or SGD with momentum, whose update scales with the gradient,
    so a gradient divided twice shows) with a per-step (or per-epoch) schedule.
    ``meta=True`` builds the layers in configure_model on the meta device (stage 3's
    large-model path)."""

    def __init__(self, interval: str = "step", meta: bool = False, sgd: bool = False) -> None:
        super().__init__()
        self.interval = interval
        self.sgd = sgd
        self.meta = meta
        self.net: nn.Module | None = None if meta else self._layers()
        self.losses: list[float] = []

    @staticmethod
    def _layers() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))

    def configure_model(self) -> None:
        if self.meta and self.net is None:
            with torch.device("meta"):
                self.net = self._layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if self.sgd
            else torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval},
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH)


class ManualRegression(TinyRegression):
    """The same model under manual optimization: manual_backward, clip_gradients,
    optimizer.step, zero_grad and the scheduler stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        self.lr_schedulers().step()
        return loss


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 7, generator=g)
    return TensorDataset(x, torch.sin(x[:, :3]) + 0.1 * torch.randn(SAMPLES, 3, generator=g))


def _trainer(strategy: Any, **options: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    return L.Trainer(strategy=strategy, **{**defaults, **options})


def _record(out: Path, name: str, trainer: L.Trainer, module: TinyRegression) -> None:
    """Collective: the run's float32 parameters and its losses, written by rank 0."""
    strategy = trainer.strategy
    if isinstance(strategy, ZeroStrategy):
        assert strategy.engine is not None
        params = strategy.engine.full_state_dict(rank=0)
    else:
        params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(
            {"params": params, "losses": module.losses, "steps": trainer.global_step},
            out / f"{name}.pt",
        )


def fit(out: Path, name: str, strategy: Any, *, ckpt_path: str | None = None,
        module: TinyRegression | None = None, **options: Any) -> L.Trainer:  # fmt: skip
    module = module or TinyRegression()
    trainer = _trainer(strategy, **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    _record(out, name, trainer, module)
    return trainer


def checkpoints_and_evaluation(out: Path) -> None:
    """Stage 3 for 2 epochs with ModelCheckpoint after each and validation during fit,
    then validate/test/predict on the trained engine, and a fit resumed from the first
    epoch's checkpoint. (From the middle of an epoch Lightning restarts a dataloader that
    is not resumable at its first batch, under ddp too: it says so, and the run differs.)"""
    module = TinyRegression()
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / "mc", every_n_epochs=1, save_top_k=-1, filename="{epoch}"
    )
    options = {"limit_val_batches": 2, "callbacks": [every_epoch], "enable_checkpointing": True}
    trainer = fit(out, "zero3_mc", ZeroStrategy(stage=3), module=module, max_epochs=2, **options)
    data = module.val_dataloader()
    metrics = {
        "validate": trainer.validate(module, dataloaders=data)[0]["val_loss"],
        "test": trainer.test(module, dataloaders=data)[0]["test_loss"],
        "predict": torch.cat(trainer.predict(module, dataloaders=data)),
        "saved": sorted(p.name for p in (out / "mc").iterdir()),
    }
    # validate on a model never fitted: the whole model, rank 0's values on every rank.
    unfitted = TinyRegression()
    unfitted_trainer = _trainer(ZeroStrategy(stage=2), limit_val_batches=2)
    metrics["validate_unfitted"] = unfitted_trainer.validate(unfitted, data)
    if trainer.global_rank == 0:
        torch.save(metrics, out / "zero3_mc_metrics.pt")
    fit(out, "zero3_mc_resumed", ZeroStrategy(stage=3), max_epochs=2,
        ckpt_path=str(out / "mc" / "epoch=0.ckpt"))  # fmt: skip


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Plain: Lightning's ddp and every stage, 4 steps, per-step schedule, clipping.
    fit(out, "ddp", "ddp", gradient_clip_val=0.5)
    for stage in (0, 1, 2, 3):
        fit(out, f"zero{stage}", ZeroStrategy(stage=stage), gradient_clip_val=0.5)
    fit(out, "zero3_by_name", "zero_stage_3", gradient_clip_val=0.5)
    # Memory-weighted shards (docs/mixed-hardware.md): the engine's layout alone.
    fit(out, "zero3_weighted", ZeroStrategy(stage=3, shard_weights=(2, 1)), gradient_clip_val=0.5)
    fit(out, "zero3_meta", ZeroStrategy(stage=3), module=TinyRegression(meta=True),
        gradient_clip_val=0.5)  # fmt: skip
    fit(out, "zero0_noclip", ZeroStrategy(stage=0))
    fit(out, "ddp_manual", "ddp", module=ManualRegression())
    for stage in (0, 3):
        fit(out, f"zero{stage}_manual", ZeroStrategy(stage=stage), module=ManualRegression())
    # Mixed precision: the Trainer's precision is the engine's param_dtype (float32 masters).
    for precision, short in (("bf16-mixed", "bf16"), ("16-mixed", "fp16")):
        for stage in (0, 3):
            fit(out, f"zero{stage}_{short}", ZeroStrategy(stage=stage), precision=precision)
    # Accumulation over 2 micro-batches: 2 steps per epoch, 2 epochs, per-epoch schedule;
    # SGD, since Adam's update hardly moves when every gradient is halved.
    accumulate = {"accumulate_grad_batches": 2, "max_epochs": 2}
    fit(out, "ddp_acc", "ddp", module=TinyRegression("epoch", sgd=True), **accumulate)
    for stage in (0, 3):
        fit(out, f"zero{stage}_acc", ZeroStrategy(stage=stage),
            module=TinyRegression("epoch", sgd=True), **accumulate)  # fmt: skip
    # Resume: 2 epochs at once, and 1 epoch + trainer.save_checkpoint + 1 more from it.
    fit(out, "zero2_whole", ZeroStrategy(stage=2), max_epochs=2)
    first = fit(out, "zero2_first", ZeroStrategy(stage=2), max_epochs=1)
    first.save_checkpoint(str(out / "zero2.ckpt"))
    fit(
        out, "zero2_resumed", ZeroStrategy(stage=2), max_epochs=2, ckpt_path=str(out / "zero2.ckpt")
    )
    # Resharded: saved by stage 2, resumed by stage 3.
    fit(out, "zero3_from_zero2", ZeroStrategy(stage=3), max_epochs=2,
        ckpt_path=str(out / "zero2.ckpt"))  # fmt: skip
    checkpoints_and_evaluation(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
