"""zero-train on mixed hardware, end to end (issue 52): two ranks running 2 and 1
micro-batch slots print the losses of three homogeneous ranks bit for bit, padded slots
included (the emulation changes times, never bits), and 'auto' chooses the speed-weighted
counts and predicts the padded step time within 15%."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zero_models.run_metrics import read_metrics


def run(*args: str, cwd: Path, **env_: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_}
    command = [sys.executable, "-m", "zero_models.train", "--model", "test", "--threads", "1",
               "--sample-tokens", "0", "--no-final-save", *args]  # fmt: skip
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")[1]]


def printed_losses(stdout: str) -> list[str]:
    return re.findall(r"^step +\d+/\d+ +loss (\S+)", stdout, re.MULTILINE)


@pytest.mark.parametrize(
    ("stage", "weights"),
    [("0", []), (None, ["--shard-weights", "2,1"]), ("3", [])],
    ids=["stage0", "default", "stage3"],
)
def test_virtual_ranks_print_the_losses_of_the_homogeneous_run(
    tmp_path: Path, stage: str | None, weights: list[str]
) -> None:
    """--nproc 2 --micro-batches-per-rank 2,1 --batch-size 18 against --nproc 3
    --batch-size 18, with accumulation and clipping: every step's loss (metrics.jsonl's
    float and the printed line) is equal, and the slots padded to 0.05 s and 0.1 s change
    nothing. At stage 0; at the default stage (3, for both runs), there with shards
    weighted 2:1 too; and at --stage 3 given: every stage and layout has stage 0's bits."""
    common = ["--batch-size", "18", "--steps", "3", "--grad-accum", "2"]
    common += [] if stage is None else ["--stage", stage]
    mixed = run("--nproc", "2", "--micro-batches-per-rank", "2,1", "--out", "mixed",
                "--emulate-micro-batch-seconds", "0.05,0.1", *weights, *common,
                cwd=tmp_path)  # fmt: skip
    assert mixed.returncode == 0, mixed.stdout + mixed.stderr
    even = run("--nproc", "3", "--out", "even", *common, cwd=tmp_path)
    assert even.returncode == 0, even.stdout + even.stderr
    assert f"stage {stage or 3}, 2 ranks" in mixed.stdout
    assert f"stage {stage or 3}, 3 ranks" in even.stdout
    assert "micro-batches per rank 2,1 (3 virtual ranks of 6 sequences)" in mixed.stdout
    assert losses(tmp_path / "mixed") == losses(tmp_path / "even")
    assert len(losses(tmp_path / "even")) == 3
    assert printed_losses(mixed.stdout) == printed_losses(even.stdout) != []
    record = read_metrics(tmp_path / "mixed" / "metrics.jsonl")[0][0]
    assert record["micro_batches_per_rank"] == [2, 1]
    assert record.get("shard_weights") == ([2.0, 1.0] if weights else None)
    # Each rank's median slot (the bench's ideal): at least its padding, 0.05 s and 0.1 s
    # (rank 1's one slot a micro-step includes the wait for the rows).
    for step in read_metrics(tmp_path / "mixed" / "metrics.jsonl")[1]:
        fast, slow = step["slot_s"]
        assert 0.05 <= fast < 0.1 <= slow, step["slot_s"]


@pytest.mark.parametrize(
    "calibrated", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["planner", "measured"]
)
def test_auto_chooses_the_speed_weighted_counts_and_predicts_the_step(
    tmp_path: Path, calibrated: bool
) -> None:
    """Slots padded to 0.1 s and 0.2 s (a 2:1 mix), 6 virtual ranks: auto measures each
    rank, chooses shard weights by free memory and counts 4,2 (2 x 0.2 s = 0.4 s a
    micro-step against the even 3,3's 0.6 s) and predicts the step time, which the
    measured median (the first step left out: start-up) is within 15% of; the run has the
    bits of the same counts given by hand. With this machine calibrated (zero-plan
    --calibrate, at the model's width) the once-per-step cost is the planner's; without,
    the profile's measured one."""
    calibration = tmp_path / "calibration.json"
    if calibrated:
        from zero_core.plan.calibrate import calibrate

        calibrate(calibration, widths=(32,))
    result = run("--nproc", "2", "--micro-batches-per-rank", "auto", "--virtual-ranks", "6",
                 "--shard-weights", "auto",
                 "--batch-size", "6", "--emulate-micro-batch-seconds", "0.1,0.2", "--steps", "6",
                 "--out", "auto", cwd=tmp_path,
                 ZERO_PLAN_CALIBRATION=str(calibration))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    source = "planner (this-machine: calibrated " if calibrated else "measured)"
    assert f"once per step: {source}" in result.stdout, result.stdout
    assert "--micro-batches-per-rank 4,2 --shard-weights " in result.stdout, result.stdout
    runs, steps = read_metrics(tmp_path / "auto" / "metrics.jsonl")
    assert runs[0]["micro_batches_per_rank"] == [4, 2]
    assert sum(runs[0]["shard_weights"]) == pytest.approx(1.0)  # in proportion to free memory
    predicted = runs[0]["auto"]["predicted_step_s"]
    measured = statistics.median(r["step_s"] for r in steps[1:])
    assert abs(measured / predicted - 1) <= 0.15, (measured, predicted)
    assert runs[0]["auto"]["even_split_step_s"] > 1.3 * predicted
    assert re.search(r"zero-train: auto: predicted step [\d.]+ s, measured median", result.stdout)
    # The profile's engine is gone without a trace, and shard weights change no bit: the
    # losses are those of the counts given by hand, with even shards.
    given = run("--nproc", "2", "--micro-batches-per-rank", "4,2", "--batch-size", "6",
                "--steps", "6", "--out", "given", cwd=tmp_path)  # fmt: skip
    assert given.returncode == 0, given.stdout + given.stderr
    assert losses(tmp_path / "given") == losses(tmp_path / "auto")
