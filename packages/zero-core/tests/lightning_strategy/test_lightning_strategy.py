"""ZeroStrategy under Lightning's own launcher (``Trainer(accelerator="cpu", devices=2)``)
and under torchrun: every stage gives the same bits, stage 0 equals Lightning's ``ddp``
within float32 rounding, and a checkpoint resumed equals the uninterrupted run.

lightning_runs.py runs every fit one after another in the same two processes (so more
than one ``Trainer.fit`` per process is exercised too); the tests read what it wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")
import torch

pytestmark = pytest.mark.integrations

RUNS = Path(__file__).with_name("lightning_runs.py")
# Lightning's ddp and our stage 0 differ only in float32 summation order: DDP all-reduces
# gradient buckets whose sums gloo orders its own way, our reduction adds rank 0 then
# rank 1; with accumulation Lightning divides each micro-batch's loss by 2 and we multiply
# it back before the engine divides the sum. Each update moves a parameter by ~lr = 0.02,
# so a few ulps of float32 (1.2e-7 relative) per step over 4 steps stay below 1e-6.
DDP_TOLERANCE = 1e-6


def _launch(out: Path, *prefix: str) -> None:
    env = dict(os.environ)  # OMP_NUM_THREADS as given: unset, Lightning sets cores / ranks
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)  # Lightning's launcher decides these
    done = subprocess.run(
        [*prefix, str(RUNS), str(out)], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    _launch(out, sys.executable)
    return out


def _load(runs: Path, name: str) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(runs / f"{name}.pt", weights_only=False)
    return result


def _assert_same_bits(runs: Path, first: str, second: str) -> None:
    a, b = _load(runs, first), _load(runs, second)
    assert a["steps"] == b["steps"] > 0
    assert list(a["params"]) == list(b["params"])
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), f"{first} vs {second}: {name} differs"


def _largest_difference(runs: Path, first: str, second: str) -> float:
    a, b = _load(runs, first), _load(runs, second)
    assert a["steps"] == b["steps"] > 0
    return max((v - b["params"][k]).abs().max().item() for k, v in a["params"].items())


@pytest.mark.parametrize(
    "run", ["zero1", "zero2", "zero3", "zero3_by_name", "zero3_meta", "zero3_weighted"]
)
def test_every_stage_gives_stage_0s_bits(runs: Path, run: str) -> None:
    """With a per-step scheduler and gradient_clip_val; zero3_by_name is
    strategy="zero_stage_3", zero3_meta builds its layers in configure_model on the meta
    device, zero3_weighted holds shards weighted 2:1 (shard_weights)."""
    _assert_same_bits(runs, "zero0", run)


def test_manual_optimization(runs: Path) -> None:
    """manual_backward, clip_gradients, optimizer.step and zero_grad by hand reach the
    engine: stage 3 gives stage 0's bits, within rounding of ddp, and the same as the
    automatic loop with clipping."""
    _assert_same_bits(runs, "zero0_manual", "zero3_manual")
    _assert_same_bits(runs, "zero0_manual", "zero0")
    assert _largest_difference(runs, "zero0_manual", "ddp_manual") <= DDP_TOLERANCE


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_stages_agree(runs: Path, dtype: str) -> None:
    """precision="bf16-mixed" / "16-mixed": 16-bit compute parameters, float32 masters;
    the result is not float32's, and stage 3 gives stage 0's bits."""
    _assert_same_bits(runs, f"zero0_{dtype}", f"zero3_{dtype}")
    assert _largest_difference(runs, f"zero0_{dtype}", "zero0_noclip") > 0


def test_stage_0_equals_lightnings_ddp(runs: Path) -> None:
    assert _load(runs, "zero0")["losses"][:1] == _load(runs, "ddp")["losses"][:1]
    largest = _largest_difference(runs, "zero0", "ddp")
    print(f"stage 0 vs ddp: largest parameter difference {largest:.3g}")
    assert largest <= DDP_TOLERANCE


def test_accumulation_equals_ddp_and_stages_agree(runs: Path) -> None:
    """accumulate_grad_batches=2 with a per-epoch scheduler: the mean over micro-batches
    is taken once (the engine's), not twice."""
    _assert_same_bits(runs, "zero0_acc", "zero3_acc")
    largest = _largest_difference(runs, "zero0_acc", "ddp_acc")
    print(f"stage 0 vs ddp with accumulation: largest parameter difference {largest:.3g}")
    assert largest <= DDP_TOLERANCE


@pytest.mark.parametrize("resumed", ["zero2_resumed", "zero3_from_zero2", "zero3_mc_resumed"])
def test_a_resumed_fit_equals_the_uninterrupted_one(runs: Path, resumed: str) -> None:
    """trainer.save_checkpoint after epoch 1, then fit(ckpt_path=...) for epoch 2: at the
    same stage, at stage 3 from stage 2's checkpoint, and from ModelCheckpoint's."""
    _assert_same_bits(runs, "zero2_whole", resumed)


def test_model_checkpoint_validate_test_predict(runs: Path) -> None:
    _assert_same_bits(runs, "zero2_whole", "zero3_mc")  # validation during fit changes nothing
    metrics = _load(runs, "zero3_mc_metrics")
    assert metrics["saved"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert metrics["validate"] > 0 and metrics["test"] > 0
    assert metrics["validate_unfitted"][0]["val_loss"] > metrics["validate"]  # untrained
    # Rank 0's predictions: the trained parameters applied to its half of the data.
    sys.path.insert(0, str(RUNS.parent))
    from lightning_runs import TinyRegression, _data

    model = TinyRegression()
    model.load_state_dict(_load(runs, "zero3_mc")["params"])
    x = _data().tensors[0][0::2]  # DistributedSampler: rank 0 reads samples 0, 2, 4, ...
    with torch.no_grad():  # batch by batch, as predict ran (a matmul's bits depend on its shape)
        expected = torch.cat([model(batch) for batch in x.split(4)])
    assert torch.equal(metrics["predict"], expected)


def test_torchrun_gives_the_launchers_bits(runs: Path, tmp_path: Path) -> None:
    """The same fits under torchrun (Lightning then starts no processes of its own)."""
    _launch(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2")  # fmt: skip
    for name in ("zero0", "zero3", "zero3_mc_resumed"):
        for key, value in _load(runs, name)["params"].items():
            assert torch.equal(value, _load(tmp_path, name)["params"][key]), (name, key)
