"""zero_core.huggingface.ZeroTrainer: the Hugging Face Trainer over zero_core, on 2 ranks.

examples/huggingface_trainer.py's tiny GPT-2 (tied head), 4 optimizer steps of AdamW with a
linear schedule, trained by ZeroTrainer at stages 0-3 and by the plain Trainer (DDP over
gloo). Promised bit for bit (``torch.equal``): every stage's losses, gradient norms and
final float32 weights equal stage 0's, with and without accumulation; a run resumed from a
checkpoint equals the uninterrupted one. Within float rounding: ZeroTrainer against the
plain Trainer. The two reduce in other orders (zero_comm's deterministic rank-order sum and
the engine's division by N after the sum, against DDP's division before its all-reduce),
so single roundings differ (at 2 ranks only the clipping norm's: without clipping the
weights are equal) and AdamW carries them through 4 steps. Measured: 6.8e-7 at most; the
tolerance, 1e-5 on weights of magnitude ~0.1, is ~100 float32 ulps and far below a wrong
step (lr 3e-3 moves each weight by ~3e-3 a step).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hf_trainer_bodies
import pytest
import torch

import zero_core
from zero_comm.testing import run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.integrations
DDP_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("hf-trainer")
    reports = run_on_ranks(hf_trainer_bodies.stages_accumulation_clipping, 2, launcher="spawn",
                           kwargs={"folder": str(folder)}, timeout=600)  # fmt: skip
    return reports[0]["value"]


@pytest.mark.parametrize("case", ["plain", "accumulation", "unclipped", "bf16", "weighted"])
def test_every_stage_equals_stage_0_bit_for_bit(runs: dict, case: str) -> None:
    report = runs[case]
    losses = list(report["losses"].values())
    norms = list(report["norms"].values())
    assert len(losses[0]) == 4 and all(x == losses[0] for x in losses), report["losses"]
    assert all(x == norms[0] for x in norms), report["norms"]
    evaluations = list(report["eval_losses"].values())  # trainer.evaluate() after training
    assert all(x == evaluations[0] for x in evaluations), report["eval_losses"]
    for stage, diff in report["stages"].items():
        assert diff["equal"], f"stage {stage}: weights differ by up to {diff['max_diff']:.3g}"


def test_weighted_shards_give_the_even_runs_bits(runs: dict) -> None:
    """ZeroConfig(shard_weights=(2, 1)) at stages 2 and 3: the plain case's stage 0."""
    diff = runs["weighted"]["plain_stage_0"]
    assert diff["equal"], f"weights differ by up to {diff['max_diff']:.3g}"
    assert runs["weighted"]["losses"]["2"] == runs["plain"]["losses"]["0"]


@pytest.mark.parametrize("case", ["plain", "accumulation", "unclipped"])
def test_the_plain_trainer_agrees_within_rounding(runs: dict, case: str) -> None:
    report = runs[case]
    print(f"{case}: largest weight difference from DDP {report['ddp']['max_diff']:.3g}")
    assert report["ddp"]["max_diff"] <= DDP_TOLERANCE
    stage_losses = next(iter(report["losses"].values()))
    assert stage_losses == pytest.approx(report["ddp_losses"], rel=1e-5)
    assert next(iter(report["norms"].values())) == pytest.approx(report["ddp_norms"], rel=1e-4)
    evaluation = next(iter(report["eval_losses"].values()))
    assert evaluation == pytest.approx(report["ddp_eval_loss"], rel=1e-5)


def test_a_model_built_on_the_meta_device_trains_to_the_same_bits(runs: dict) -> None:
    """ZeroTrainer(meta model, init_values=...) at stage 3: no rank builds it whole."""
    assert runs["meta"]["equal"], runs["meta"]
    assert runs["meta"]["losses"] == next(iter(runs["plain"]["losses"].values()))


def test_bf16_compute_trains_near_the_float32_run(runs: dict) -> None:
    """ZeroConfig(param_dtype="bf16"): bf16 compute, float32 masters; its losses stay
    within bf16's rounding (2**-8 relative) of the float32 run's, and differ from them."""
    bf16 = next(iter(runs["bf16"]["losses"].values()))
    float32 = next(iter(runs["plain"]["losses"].values()))
    assert bf16 != float32
    assert bf16 == pytest.approx(float32, rel=2**-7)


def test_max_grad_norm_clips(runs: dict) -> None:
    """The clipped run's norms were above 1.0, so clipping changed the weights."""
    assert min(next(iter(runs["plain"]["norms"].values()))) > 1.0
    assert not runs["unclipped"]["clipped_vs_unclipped"]["equal"]
    assert runs["unclipped"]["clipped_vs_unclipped"]["max_diff"] > 1e-4


@pytest.mark.parametrize(("stage", "resume_stage"), [(3, 3), (2, 1)])
def test_a_resumed_run_equals_the_uninterrupted_one(
    tmp_path: Path, stage: int, resume_stage: int
) -> None:
    kwargs = {"folder": str(tmp_path), "stage": stage, "resume_stage": resume_stage}
    reports = run_on_ranks(hf_trainer_bodies.save_and_resume, 2, kwargs=kwargs, timeout=300)
    report = reports[0]["value"]
    assert report["resumed"]["equal"], report["resumed"]
    assert report["resumed_losses"] == report["whole_losses"][2:]
    assert report["exported"] and all(report["exported"].values()), report["exported"]
    assert "zero_state" in report["files"] and "optimizer.pt" not in report["files"]


def test_accelerator_prepare_of_an_engine_managed_model_names_zero_trainer() -> None:
    """Before: Accelerate's prepare_model took it (and, on several processes, wrapped it
    in DistributedDataParallel over the engine's views or stage 3's placeholders)."""
    from accelerate import Accelerator

    import zero_comm
    import zero_core.huggingface  # installs the guard

    assert zero_core.huggingface.ZeroTrainer
    comm = zero_comm.init(deterministic=True)
    free = torch.nn.Linear(4, 4)
    accelerator = Accelerator(cpu=True)
    assert accelerator.prepare(free) is free  # no engine trains it: prepared as before
    model = torch.nn.Linear(4, 4)
    engine = zero_core.initialize(model, torch.optim.AdamW, zero_core.ZeroConfig(stage=3), comm)
    with pytest.raises(ValueError, match=r"trained by a zero_core engine \(stage 3\).*ZeroTrainer"):
        accelerator.prepare(model)
    engine.close()
    assert accelerator.prepare(model) is model  # a closed engine lets go of it


def test_initialize_guards_an_accelerate_loop_that_never_imports_zero_core_huggingface() -> None:
    """A plain Accelerate loop: accelerate imported first, then zero_core.initialize; the
    guard is installed by initialize (a fresh interpreter: this one installed it already)."""
    script = """
import accelerate, torch, zero_comm, zero_core, sys
model = torch.nn.Linear(4, 4)
engine = zero_core.initialize(model, torch.optim.AdamW, zero_core.ZeroConfig(stage=2),
                              zero_comm.init(deterministic=True))
assert "zero_core.huggingface" not in sys.modules
try:
    accelerate.Accelerator(cpu=True).prepare(model)
except ValueError as refused:
    print("refused:", refused)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: accelerator.prepare(model): Linear (parameter weight)" in result.stdout
    assert "zero_core.huggingface.ZeroTrainer" in result.stdout


def test_an_accumulation_window_cut_short_by_the_epoch_raises(tmp_path: Path) -> None:
    """8 batches an epoch in windows of 3: the third window has 2. Before, engine.step()
    applied nothing there (it waits for all 3) and the Trainer went on, its scheduler
    advanced, the 2 micro-batches' gradients dropped."""
    example = hf_trainer_bodies.load_example()
    args = example.arguments(str(tmp_path), gradient_accumulation_steps=3, max_steps=4)
    trainer = example.make_trainer(args, 2, example.LossHistory())
    with pytest.raises(
        RuntimeError, match=r"window after 2 of gradient_accumulation_steps=3 micro"
    ):
        trainer.train()


def test_settings_it_cannot_honour_are_refused_together(tmp_path: Path) -> None:
    example = hf_trainer_bodies.load_example()
    args = example.arguments(str(tmp_path), bf16=True, gradient_accumulation_steps=2)
    config = zero_core.ZeroConfig(stage=3, clip_grad_norm=1.0, gradient_accumulation_steps=4)
    from zero_core.huggingface import ZeroTrainer

    with torch.device("meta"):
        model = example.tiny_gpt2()
    with pytest.raises(ValueError) as refused:
        ZeroTrainer(model, args, zero_config=config)
    message = str(refused.value)
    assert "ZeroConfig(param_dtype='bf16'" in message
    assert "TrainingArguments(max_grad_norm=...)" in message
    assert "ZeroConfig(gradient_accumulation_steps=4) differs" in message
    assert "on the meta device (transformer.wte.weight, ...) and no init_values" in message


def test_the_tested_versions_are_the_ones_nox_and_the_extra_install() -> None:
    """ZeroTrainer overrides private Trainer methods: the versions it names, the extra
    zero-core[huggingface] and nox's integrations session must be one set, and installed."""
    import accelerate
    import transformers

    from zero_core.huggingface import TESTED_VERSIONS

    root = Path(__file__).resolve().parents[1]
    pins = [f"{name}=={version}" for name, version in TESTED_VERSIONS.items()]
    extra = (root / "packages" / "zero-core" / "pyproject.toml").read_text()
    noxfile = (root / "noxfile.py").read_text()
    for pin in pins:
        assert f'"{pin}"' in extra, pin
        assert f'"{pin}"' in noxfile, pin
    assert transformers.__version__ == TESTED_VERSIONS["transformers"]
    assert accelerate.__version__ == TESTED_VERSIONS["accelerate"]


def test_the_example_runs_under_torchrun(tmp_path: Path) -> None:
    """examples/huggingface_trainer.py as a user runs it: torchrun, 2 CPU processes, the
    process group made by Accelerate and adopted by ZeroTrainer (the other tests start
    their ranks with zero-launch)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(hf_trainer_bodies.EXAMPLE), "--steps", "2",
               "--stage", "3", "--output-dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZeroTrainer, stage 3, 2 processes" in result.stdout
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 2, result.stdout[-2000:]


def test_a_step_the_engine_skips_does_not_advance_the_scheduler(tmp_path: Path) -> None:
    """A NaN loss at the second step: the engine skips that update (ZeroConfig's nonfinite
    "skip"), the Trainer's scheduler is told and stays, and the weights stay finite. Before,
    the Trainer saw every step as applied and advanced its scheduler past the skipped one."""
    from zero_core.huggingface import ZeroTrainer

    class NanAtStep2(ZeroTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * float("nan") if self.state.global_step == 1 else loss

    example = hf_trainer_bodies.load_example()
    trainer = NanAtStep2(
        example.tiny_gpt2(), example.arguments(str(tmp_path), max_steps=4),
        zero_config=zero_core.ZeroConfig(stage=2), train_dataset=example.counting_data(),
    )  # fmt: skip
    trainer.train()
    assert trainer.engine.global_steps == 3 and trainer.engine.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == 3  # 4 Trainer steps, 3 applied
    assert all(v.isfinite().all() for v in trainer.engine.full_state_dict().values())
