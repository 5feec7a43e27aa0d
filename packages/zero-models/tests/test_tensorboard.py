"""zero-train --tensorboard: rank 0's event files hold metrics.jsonl's values at its steps,
a resumed run adds to the same folder, and without the package the option stops at option
checking with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_models.run_metrics import read_metrics

MISSING = (
    "zero-train: error: --tensorboard needs the tensorboard package: "
    "pip install 'zero-models[tensorboard]'"
)


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zero_models.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


@pytest.mark.slow  # 18 s: nox -s slow; the default run keeps the event-file checks below
def test_event_files_hold_the_metrics_at_their_steps_and_resume_appends(tmp_path: Path) -> None:
    """2 steps on 2 ranks that save, then --resume auto to step 4: OUT/tensorboard holds
    two event files, read back as one run whose every scalar has metrics.jsonl's steps and
    values."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["--model", "test", "--steps", "4", "--batch-size", "4", "--sample-tokens", "4",
              "--threads", "1", "--out", "o", "--tensorboard"]  # fmt: skip
    first = run(*common, "--stop-after", "2", "--save-every", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = run(*common, "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 2" in resumed.stdout
    folder = tmp_path / "o" / "tensorboard"
    assert f"wrote TensorBoard events to {Path('o') / 'tensorboard'}" in resumed.stdout
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one per run segment

    _, records = read_metrics(tmp_path / "o" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        scalars = {
            "train/loss": r["loss"],
            "train/lr": r["lr"],
            "train/tokens_per_s": r["tokens_per_s"],
            "train/grad_norm": r["grad_norm"],  # --clip 1.0 computes it
            **{f"memory/rss_mib/rank{k}": mib for k, mib in enumerate(r["rss_mib"])},
        }
        for tag, value in scalars.items():
            expected.setdefault(tag, []).append((r["step"], value))
    assert "memory/rss_mib/rank1" in expected  # one tag per rank
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        read = events.Scalars(tag)
        assert [e.step for e in read] == [step for step, _ in points], tag
        assert [e.value for e in read] == pytest.approx([v for _, v in points], rel=1e-6), tag


def test_without_the_package_the_option_stops_with_one_line(tmp_path: Path) -> None:
    """A `tensorboard` on PYTHONPATH that fails to import stands for a missing package."""
    shim = tmp_path / "shim" / "tensorboard"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('tensorboard hidden by the test')\n")
    paths = [str(tmp_path / "shim"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    result = run("--model", "test", "--tensorboard", "--out", "o", cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{MISSING} (zero-train --help lists the options)"
    ]
    assert "Traceback" not in result.stderr and "step" not in result.stdout
    assert not (tmp_path / "o").exists()  # stopped before any rank started


def test_the_folder_is_out_tensorboard_unless_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zero_models import train_options

    monkeypatch.setattr(train_options, "tensorboard_available", lambda: True)
    out = tmp_path / "o"
    assert train_options.parse_options(["--out", str(out)]).tensorboard is None
    args = train_options.parse_options(["--out", str(out), "--tensorboard"])
    assert args.tensorboard == out / "tensorboard"
    args = train_options.parse_options(["--out", str(out), "--tensorboard", "tb", "--steps", "3"])
    assert (args.tensorboard, args.steps) == (Path("tb"), 3)


def test_a_resumed_writer_hides_what_the_cut_off_run_logged_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    """A run killed after logging steps 0-3 whose checkpoint was at step 2: the resumed
    writer (first step 2) replaces steps 2 and 3 instead of doubling them; a step without
    a gradient norm has no grad_norm point."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zero_models.run_tensorboard import TensorBoardLog

    def record(step: int, loss: float) -> dict[str, object]:
        return {"step": step, "loss": loss, "lr": 0.5, "tokens_per_s": 8.0, "rss_mib": [64.0],
                "grad_norm": None}  # fmt: skip

    cut_off = TensorBoardLog(tmp_path, first_step=0)
    for step in range(4):
        cut_off.write(record(step, 10 + step))
    cut_off.close()
    started = int(time.time())
    while int(time.time()) == started:  # event files sort by their names' whole seconds
        time.sleep(0.05)
    resumed = TensorBoardLog(tmp_path, first_step=2)
    for step in range(2, 5):
        resumed.write(record(step, 20 + step))
    resumed.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert "train/grad_norm" not in events.Tags()["scalars"]
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(0, 10), (1, 11), (2, 22), (3, 23), (4, 24)]
