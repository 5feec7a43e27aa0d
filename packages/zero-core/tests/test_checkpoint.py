"""Checkpoints: exact resume, resharding to any world size and stage, corruption named,
consolidation to a plain state dict, import from one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParityCase, build_engine, loss_of, micro_batch, normalised

import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.checkpoint.consolidate import SavedModel, consolidate

CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                  dtype="bfloat16", bucket_numel=300, persistence_threshold=0)  # fmt: skip


def run_steps(engine: zero_core.ZeroEngine, case: ParityCase, comm: Communicator,
              first: int, count: int) -> list[float]:  # fmt: skip
    """Steps first .. first+count-1 (global micro-batch numbering as parity.train)."""
    losses = []
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[case.dtype]  # fmt: skip
    for step in range(first, first + count):
        for micro in range(case.accumulation):
            x, target = micro_batch(case, (step * case.accumulation + micro) * comm.world_size
                                    + comm.rank)  # fmt: skip
            loss = loss_of(case, engine(x if case.vocab else x.to(dtype)), target)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bit_exact(stage: int, dtype: str, tmp_path: Path) -> None:
    """Save after step 2, load into a fresh engine (fresh model), continue: parameters
    and losses equal a run that never stopped. In float32 the master weights are the
    parameters (or, at stages 1 and 2, this rank's slices of them)."""
    case = normalised(ParityCase(**{**CASE.__dict__, "dtype": dtype}))

    def body(comm: Communicator) -> None:
        straight = build_engine(case, comm, stage)
        run_steps(straight, case, comm, 0, 2)
        straight.save(tmp_path / "ckpt", extra={"next_step": 2})
        expected_losses = run_steps(straight, case, comm, 2, 2)
        expected = straight.full_state_dict()
        resumed = build_engine(case, comm, stage)
        extra = resumed.load(tmp_path / "ckpt")
        assert extra == {"next_step": 2} and resumed.global_steps == 2
        assert run_steps(resumed, case, comm, extra["next_step"], 2) == expected_losses
        state = resumed.full_state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)

    run_simulated(3, body)


def logical_state(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter's master and optimizer states, full, from a checkpoint."""
    saved = SavedModel(path)
    out = {}
    keys = [
        n.split(".", 2)[2] for n in saved.file_of(_writer(saved)).names if n.startswith("state.0.")
    ]
    for g, i, name, _ in saved.parameters():
        out[name] = saved.parameter(g, i)
        for key in keys:
            out[f"{name}:{key}"] = saved.parameter(g, i, key)
    for g, group in enumerate(saved.index["groups"]):
        for key, value in group["scalar_states"].items():
            out[f"group{g}:{key}"] = torch.tensor(value["value"])
    return out


def _writer(saved: SavedModel) -> int:
    return next(r for r, e in enumerate(saved.index["ranks"]) if e["pieces"] is not None)


RUN = st.tuples(
    st.sampled_from([1, 2, 3, 4]), st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["bfloat16", "float32"]),
)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(before=RUN, after=RUN, bucket=st.sampled_from([64, 300, 1 << 20]))
def test_a_checkpoint_loads_at_any_world_size_and_stage(
    before: tuple[int, int, str], after: tuple[int, int, str], bucket: int,
    tmp_path_factory: Any,
) -> None:  # fmt: skip
    """Saved by N ranks at stage s, loaded by M ranks at stage t (each in bfloat16 or
    float32, whose master weights are the parameters): the logical state (every
    parameter's float32 master and optimizer states, the scalars) is bit-identical, and
    training goes on exactly as stage 0 loaded from the same file."""
    (n, s, saved_dtype), (m, t, dtype) = before, after
    case = normalised(ParityCase(**{**CASE.__dict__, "bucket_numel": bucket, "dtype": dtype}))
    saved_case = ParityCase(**{**case.__dict__, "dtype": saved_dtype})
    folder = tmp_path_factory.mktemp("reshard")

    def save_body(comm: Communicator) -> None:
        engine = build_engine(saved_case, comm, s)
        run_steps(engine, saved_case, comm, 0, 2)
        engine.save(folder / "first")

    def load_body(comm: Communicator) -> dict[str, torch.Tensor]:
        engine = build_engine(case, comm, t)
        engine.load(folder / "first")
        engine.save(folder / "again")
        run_steps(engine, case, comm, 2, 1)
        oracle = build_engine(case, comm, 0)
        oracle.load(folder / "first")
        run_steps(oracle, case, comm, 2, 1)
        state, expected = engine.full_state_dict(), oracle.full_state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        return state

    run_simulated(n, save_body)
    run_simulated(m, load_body)
    first, again = logical_state(folder / "first"), logical_state(folder / "again")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first), (before, after)


def saved_once(folder: Path, stage: int = 2, world_size: int = 2) -> None:
    case = normalised(CASE)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage)
        run_steps(engine, case, comm, 0, 1)
        engine.save(folder.parent, tag=folder.name)  # the checkpoint is ``folder`` itself

    run_simulated(world_size, body)


def load_error(folder: Path, case: ParityCase | None = None) -> str:
    case = normalised(case or CASE)

    def body(comm: Communicator) -> None:
        build_engine(case, comm, 2).load(folder)

    with pytest.raises(SimulatedRankError) as failure:
        run_simulated(2, body)
    cause = failure.value.__cause__
    assert isinstance(cause, zero_core.CheckpointError), cause
    return str(cause)


def test_corrupt_truncated_missing_and_foreign_checkpoints_are_named(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    saved_once(folder)
    shard = folder / "rank-00001.safetensors"
    original = shard.read_bytes()

    data = bytearray(original)
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    message = load_error(folder)
    assert "rank-00001.safetensors" in message and "fails its checksum" in message

    shard.write_bytes(original[:-100])
    message = load_error(folder)
    assert "rank-00001.safetensors" in message and "truncated" in message

    shard.unlink()
    assert "rank-00001.safetensors: missing" in load_error(folder)

    shard.write_bytes(original)
    other = ParityCase(**{**CASE.__dict__, "widths": (5, 131, 7)})
    message = load_error(folder, other)
    assert "another model" in message and "(131, 5)" in message and "(130, 5)" in message

    assert "no checkpoint at" in load_error(tmp_path / "nothing")


def test_an_interrupted_swap_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    """Killed between moving the old checkpoint aside and renaming the new one in: the
    old one is loaded from CKPT.old; an unfinished CKPT.saving is ignored."""
    folder = tmp_path / "ckpt"
    saved_once(folder)
    folder.rename(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.saving").mkdir()

    def body(comm: Communicator) -> int:
        engine = build_engine(normalised(CASE), comm, 2)
        engine.load(folder)
        return engine.global_steps

    assert run_simulated(2, body) == [1, 1]


def test_consolidated_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    """Stage 3 on 3 ranks -> zero-consolidate -> load_state_dict(strict) into the plain
    model (tied weight under both names); and back: training starts from that file."""
    from parity import ParityModel

    case = normalised(CASE)
    folder, out = tmp_path / "ckpt", tmp_path / "model.safetensors"

    def body(comm: Communicator) -> dict[str, torch.Tensor]:
        engine = build_engine(case, comm, 3)
        run_steps(engine, case, comm, 0, 2)
        engine.save(folder)
        return engine.full_state_dict()

    expected = run_simulated(3, body)[0]
    assert consolidate(folder, out, torch.float32) == out.stat().st_size
    plain = ParityModel(case)
    plain.load_state_dict(dict(zero_core.read_state_dict(out)), strict=True)
    assert all(torch.equal(plain.state_dict()[k], expected[k]) for k in expected)
    assert plain.head.weight is plain.embedding.weight  # type: ignore[union-attr]

    def start_from_file(comm: Communicator) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = ParityModel(case)
        engine = zero_core.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            zero_core.ZeroConfig(stage=3, persistence_threshold=0), comm,
            init_values=zero_core.read_state_dict(out),
        )  # fmt: skip
        return engine.full_state_dict()

    imported = run_simulated(2, start_from_file)[0]
    assert all(torch.equal(imported[k], expected[k]) for k in expected)


def test_a_save_killed_at_random_moments_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    """A real process trains and saves after every step; it is killed (SIGKILL) at
    random moments, every other time just after a save began. Each time, the checkpoint
    it leaves loads and holds exactly the state of a run of the steps it records."""
    import json
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from checkpoint_saver import CASE, train_and_save

    from zero_comm.determinism import current_fingerprint, fingerprint_differences

    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    rng = random.Random(7)
    mid_save = 0
    for trial in range(6):
        folder = tmp_path / f"trial{trial}"
        staging = folder.with_name(folder.name + ".saving")
        process = subprocess.Popen([sys.executable, str(here / "checkpoint_saver.py"), str(folder)],
                                   env=env)  # fmt: skip
        deadline = time.monotonic() + 120
        while not (folder / "index.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if trial % 2:  # aim inside a save: wait for the next one to start
            while not staging.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            time.sleep(rng.uniform(0.0, 1.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
        mid_save += staging.exists()

        # The saver computed under this process's fingerprint (threads included), or the
        # bitwise comparison below would say nothing about the checkpoint.
        index = folder / "index.json"
        if not index.exists():  # killed while swapping: load() takes the previous one
            index = folder.with_name(folder.name + ".old") / "index.json"
        saved_under = json.loads(index.read_text())["fingerprint"]
        assert fingerprint_differences(saved_under, current_fingerprint()) == []

        def body(comm: Communicator, folder: Path = folder) -> tuple[int, dict[str, torch.Tensor]]:
            engine = build_engine(CASE, comm, 2)
            steps = engine.load(folder)["steps"]
            assert engine.global_steps == steps
            return steps, engine.full_state_dict()

        steps, state = run_simulated(2, body)[0]
        expected = run_simulated(2, lambda comm, n=steps: train_and_save(comm, None, n))[0]
        assert all(torch.equal(state[k], expected[k]) for k in expected), (trial, steps)
    assert mid_save >= 1  # at least one kill landed inside a save


def test_shards_are_plain_safetensors_that_other_readers_load(tmp_path: Path) -> None:
    """The reference safetensors library reads our shards and gets our values."""
    from safetensors.torch import load_file

    from zero_core.checkpoint.safetensors_file import TensorFile

    saved_once(tmp_path / "ckpt", stage=3)
    for shard in sorted((tmp_path / "ckpt").glob("rank-*.safetensors")):
        theirs = load_file(shard)
        ours = dict(TensorFile(shard).tensors())
        assert theirs.keys() == ours.keys() and "master.0" in ours
        assert all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_each_rank_reads_only_the_byte_ranges_it_holds(tmp_path: Path) -> None:
    """A one-rank stage 0 checkpoint loaded by 4 ranks at stage 3: each rank reads about
    a quarter of the masters and states (plus at most one checksum block at each end of
    each piece), not the whole file."""
    import threading

    from zero_core.checkpoint import safetensors_file

    case = normalised(ParityCase(widths=(64, 1024, 1024, 64), optimizer="adam",
                                 persistence_threshold=0, bucket_numel=1 << 16))  # fmt: skip

    def save_body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 0)
        run_steps(engine, case, comm, 0, 1)
        engine.save(tmp_path, tag="ckpt")

    run_simulated(1, save_body)
    shard_bytes = (tmp_path / "ckpt" / "rank-00000.safetensors").stat().st_size
    read: dict[int, int] = {}
    original = safetensors_file.TensorFile._read_bytes

    def counting(self: Any, first: int, last: int) -> bytearray:
        data = original(self, first, last)
        key = threading.get_ident()
        read[key] = read.get(key, 0) + len(data)
        return data

    def load_body(comm: Communicator) -> None:
        build_engine(case, comm, 3).load(tmp_path / "ckpt")

    safetensors_file.TensorFile._read_bytes = counting  # type: ignore[method-assign]
    try:
        run_simulated(4, load_body)
    finally:
        safetensors_file.TensorFile._read_bytes = original  # type: ignore[method-assign]
    assert len(read) == 4
    assert all(0.2 * shard_bytes < n < 0.3 * shard_bytes for n in read.values()), (
        shard_bytes, read)  # fmt: skip


def loaded_with_warnings(folder: Path, world_size: int = 2) -> list[str]:
    """Load ``folder`` into ``world_size`` simulated ranks; the DeterminismWarnings given."""
    import warnings

    case = normalised(CASE)

    def body(comm: Communicator) -> None:
        build_engine(case, comm, 2).load(folder)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_simulated(world_size, body)
    return [str(w.message) for w in caught if w.category is zero_core.DeterminismWarning]


def test_the_index_records_each_ranks_fingerprint(tmp_path: Path) -> None:
    import json

    from zero_comm.determinism import current_fingerprint

    saved_once(tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    now = current_fingerprint().to_json()
    assert index["fingerprint"] == now
    assert [rank["fingerprint"] for rank in index["ranks"]] == [now, now]
    assert index["deterministic_reductions"] is True


def test_a_resume_under_other_threads_warns_once_naming_the_difference(tmp_path: Path) -> None:
    """Saved with one thread count, loaded with another: one warning (from rank 0, not one
    per rank) that names both counts and what follows; none under the same fingerprint."""
    saved_once(tmp_path / "ckpt")
    assert loaded_with_warnings(tmp_path / "ckpt") == []
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        warned = loaded_with_warnings(tmp_path / "ckpt", world_size=3)
    finally:
        torch.set_num_threads(threads)
    assert len(warned) == 1
    assert f"saved with threads per rank {threads}, resumed with {threads + 1}" in warned[0]
    assert "will not be bitwise identical to an uninterrupted run" in warned[0]
