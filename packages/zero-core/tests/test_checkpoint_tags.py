"""A folder of tagged checkpoints (DIR/<tag>/ + DIR/latest): a save never deletes what it
did not write, a load follows latest or takes a tag, keep_last prunes only our own
checkpoints, and ranks that disagree on where to save are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import ParityCase, build_engine, normalised
from test_checkpoint import CASE, run_steps

import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.checkpoint.tags import check_tag

SMALL = normalised(ParityCase(**{**CASE.__dict__, "widths": (5, 30, 7)}))


def user_files(folder: Path) -> dict[str, str]:
    """Files a user keeps in their experiment folder, as HelloDeepSpeed does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hparams.json").write_text('{"lr": 0.1}')
    (folder / "tb").mkdir()
    (folder / "tb" / "events.out").write_text("events")
    (folder / "notes").mkdir()  # a folder of theirs, no checkpoint inside
    (folder / "notes" / "a.txt").write_text("mine")
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def still_there(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        assert (folder / name).read_text() == text, name


def save_steps(folder: Path, steps: list[int], **save: object) -> list[dict[str, torch.Tensor]]:
    """Train, saving into ``folder`` after each of ``steps``; the full state at each save."""

    def body(comm: Communicator) -> list[dict[str, torch.Tensor]]:
        engine = build_engine(SMALL, comm, 2)
        states, done = [], 0
        for step in steps:
            run_steps(engine, SMALL, comm, done, step - done)
            done = step
            engine.save(folder, extra={"step": step}, **save)  # type: ignore[arg-type]
            states.append(engine.full_state_dict())
        return states

    return run_simulated(2, body)[0]


def loaded(folder: Path, tag: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    def body(comm: Communicator) -> tuple[int, dict[str, torch.Tensor]]:
        engine = build_engine(SMALL, comm, 2)
        extra = engine.load(folder, tag=tag)
        return int(extra["step"]), engine.full_state_dict()

    return run_simulated(2, body)[0]


def test_a_save_keeps_the_users_files_and_load_follows_latest(tmp_path: Path) -> None:
    folder = tmp_path / "experiment"
    files = user_files(folder)
    states = save_steps(folder, [1, 2])
    still_there(folder, files)
    assert (folder / "latest").read_text().strip() == "global_step2"
    assert (folder / "global_step1" / "index.json").is_file()
    step, state = loaded(folder)
    assert step == 2 and all(torch.equal(state[k], states[1][k]) for k in state)
    step, state = loaded(folder, tag="global_step1")
    assert step == 1 and all(torch.equal(state[k], states[0][k]) for k in state)


def test_keep_last_removes_only_older_checkpoints_of_ours(tmp_path: Path) -> None:
    folder = tmp_path / "experiment"
    files = user_files(folder)
    save_steps(folder, [1, 2, 3], keep_last=2)
    still_there(folder, files)
    kept = sorted(p.name for p in folder.iterdir() if (p / "index.json").exists())
    assert kept == ["global_step2", "global_step3"]
    assert loaded(folder)[0] == 3


def test_a_users_folder_under_the_tag_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "experiment"
    user_files(folder)
    (folder / "global_step1").mkdir()
    (folder / "global_step1" / "mine.txt").write_text("keep me")
    with pytest.raises(SimulatedRankError) as failure:
        save_steps(folder, [1])
    assert isinstance(failure.value.__cause__, zero_core.CheckpointError)
    assert "is not a checkpoint" in str(failure.value.__cause__)
    assert (folder / "global_step1" / "mine.txt").read_text() == "keep me"
    assert not (folder / "latest").exists()


def test_ranks_that_save_to_different_folders_are_named_on_every_rank(tmp_path: Path) -> None:
    def body(comm: Communicator) -> str:
        engine = build_engine(SMALL, comm, 2)
        run_steps(engine, SMALL, comm, 0, 1)
        try:
            engine.save(tmp_path / f"rank{comm.rank}")
        except zero_core.CheckpointError as exc:
            return str(exc)
        return ""

    messages = run_simulated(2, body)
    for message in messages:
        assert "different checkpoint folders" in message, message
        assert f"rank 0: {tmp_path.resolve() / 'rank0'}" in message
        assert f"rank 1: {tmp_path.resolve() / 'rank1'}" in message
    assert not (tmp_path / "rank0").exists() and not (tmp_path / "rank1").exists()


def test_latest_naming_a_missing_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    folder = tmp_path / "experiment"
    save_steps(folder, [1])
    (folder / "latest").write_text("global_step9\n")
    with pytest.raises(zero_core.CheckpointError, match="names checkpoint global_step9"):
        zero_core.complete_checkpoint(folder)
    with pytest.raises(SimulatedRankError) as failure:
        loaded(folder)
    assert "global_step9" in str(failure.value.__cause__)


def test_a_folder_saved_before_tags_still_loads(tmp_path: Path) -> None:
    """One checkpoint per folder (DIR/index.json), as every save wrote it before tags."""
    folder = tmp_path / "old-layout"
    states = save_steps(tmp_path, [1], tag="old-layout")
    assert (folder / "index.json").is_file() and not (folder / "latest").exists()
    step, state = loaded(folder)
    assert step == 1 and all(torch.equal(state[k], states[0][k]) for k in state)
    index = json.loads((folder / "index.json").read_text())
    assert index["engine"]["global_steps"] == 1


@pytest.mark.parametrize("tag", ["", "a/b", ".hidden", "latest", "..", "x\\y"])
def test_a_tag_must_name_one_folder(tag: str) -> None:
    with pytest.raises(ValueError, match="must name one folder"):
        check_tag(tag)
