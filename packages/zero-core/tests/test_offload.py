"""Offload tiers (ZeRO-Offload / ZeRO-Infinity): every tier equals the device-only engine
bit for bit; swap files are checked, named and never consumed when torn; a full or
unusable offload_dir is named; checkpoints resume exactly across tiers."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    build_engine,
    normalised,
    offloaded_parity_cases,
    tiers_equal_stage0,
)
from test_checkpoint import run_steps

import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.component_access import disk_swap

CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                  dtype="bfloat16", bucket_numel=300, persistence_threshold=0,
                  sub_group_numel=64)  # fmt: skip


def with_tiers(case: ParityCase, optimizer: str, params: str, **more: object) -> ParityCase:
    tiers = {"offload_optimizer": optimizer, "offload_params": params, **more}
    return normalised(ParityCase(**{**case.__dict__, **tiers}))


@settings(max_examples=15, deadline=None)
@given(case=offloaded_parity_cases(), world_size=st.sampled_from([1, 2, 3, 4]))
def test_every_tier_equals_the_device_only_engine_bit_for_bit(
    case: ParityCase, world_size: int
) -> None:
    """Stages 1-3 with the drawn tiers (masters and optimizer states on host or disk,
    parameters too at stage 3, any fraction and sub-group size) equal stage 0 without
    offload after every step."""
    run_simulated(world_size, lambda comm: tiers_equal_stage0(comm, case))


def test_the_tiers_hold_what_they_say(tmp_path: Path) -> None:
    """Stage 3, everything on disk: no master or optimizer state and no parameter shard
    on the device; the swap files hold them; the disk tier's buffers are bounded."""
    case = with_tiers(CASE, "disk", "disk")

    def body(comm: Communicator) -> zero_core.MemoryReport:
        engine = build_engine(case, comm, 3)
        run_steps(engine, case, comm, 0, 2)
        report = engine.memory_report()
        device_only = build_engine(normalised(CASE), comm, 3)
        run_steps(device_only, normalised(CASE), comm, 0, 2)
        plain = device_only.memory_report()
        assert report.master_weights == report.optimizer_states == 0
        assert plain.master_weights > 0 and plain.optimizer_states > 0
        # float32 master + exp_avg + exp_avg_sq, and the bfloat16 shard, on disk
        shard = plain.master_weights // 4
        assert report.disk >= shard * (4 + 4 + 4 + 2)
        assert report.parameters < plain.parameters
        folder = disk_swap(engine).folder
        assert any(folder.iterdir())
        engine.close()
        assert not folder.exists(), "closing the engine removes its swap files"
        return report

    run_simulated(2, body)


def test_a_corrupt_swap_file_is_named_not_consumed(tmp_path: Path) -> None:
    case = with_tiers(CASE, "disk", "none")

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        run_steps(engine, case, comm, 0, 1)
        swap = disk_swap(engine)
        victim = sorted(swap.folder.glob("*.exp_avg.swap"))[0]
        with open(victim, "r+b") as file:
            file.seek(8)
            byte = file.read(1)
            file.seek(8)
            file.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(zero_core.CorruptSwapError, match=victim.name):
            run_steps(engine, case, comm, 1, 1)
        engine.close()

    run_simulated(1, body)


def test_a_full_disk_during_swap_out_names_the_folder_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = with_tiers(CASE, "disk", "none")

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        run_steps(engine, case, comm, 0, 1)
        engine.save(tmp_path / "ckpt")
        saved = engine.full_state_dict()

        def no_space(*args: object, **kwargs: object) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with monkeypatch.context() as patch:
            patch.setattr(os, "pwrite", no_space)
            patch.setattr(os, "pwritev", no_space, raising=False)
            with pytest.raises(zero_core.SwapSpaceError, match="zero-swap") as caught:
                run_steps(engine, case, comm, 1, 1)
        assert "bytes" in str(caught.value)
        engine.close()
        resumed = build_engine(case, comm, 2)
        resumed.load(tmp_path / "ckpt")
        state = resumed.full_state_dict()
        assert all(torch.equal(state[k], saved[k]) for k in saved)
        resumed.close()

    run_simulated(1, body)


@pytest.mark.parametrize(
    ("folder", "match"),
    [("missing", "create it|does not exist"), ("file", "not a folder|not a directory")],
)
def test_an_unusable_offload_dir_is_refused_before_anything_is_built(
    folder: str, match: str, tmp_path: Path
) -> None:
    target = tmp_path / "swap"
    if folder == "file":
        target.write_text("")
    with pytest.raises(ValueError, match=match):
        zero_core.ZeroConfig(stage=2, offload_optimizer="disk", offload_dir=str(target))
        zero_core.check_offload_dir(target, 0)
    config = zero_core.ZeroConfig(stage=2, offload_optimizer="disk", offload_dir=str(target))

    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(4, 4)
        zero_core.initialize(model, torch.optim.AdamW(model.parameters()), config, comm)

    with pytest.raises(SimulatedRankError, match=match):
        run_simulated(1, body)


def test_too_little_space_names_the_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Tiny:
        f_bavail, f_frsize, f_flag = 1, 4096, 0

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
    config = zero_core.ZeroConfig(stage=2, offload_optimizer="disk", offload_dir=str(tmp_path))

    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(64, 64)
        zero_core.initialize(model, torch.optim.AdamW(model.parameters()), config, comm)

    with pytest.raises(SimulatedRankError, match="bytes"):
        run_simulated(1, body)


def test_an_optimizer_that_makes_its_state_at_construction_is_refused_on_disk(
    tmp_path: Path,
) -> None:
    config = zero_core.ZeroConfig(stage=1, offload_optimizer="disk", offload_dir=str(tmp_path))

    def body(comm: Communicator) -> None:
        model = torch.nn.Linear(4, 4)
        zero_core.initialize(model, torch.optim.Adagrad(model.parameters()), config, comm)

    with pytest.raises(SimulatedRankError, match="Adagrad creates its state"):
        run_simulated(1, body)


@pytest.mark.parametrize(
    ("saved", "resumed", "world"),
    [(("disk", "disk", 3), ("none", "none", 3), 2), (("none", "none", 2), ("disk", "cpu", 3), 3),
     (("cpu", "none", 1), ("disk", "none", 2), 2)],
)  # fmt: skip
def test_resume_across_tiers_is_bit_exact(
    saved: tuple[str, str, int], resumed: tuple[str, str, int], world: int, tmp_path: Path
) -> None:
    """Save from one tier and stage, load into another: the losses and state equal the
    run that never stopped (which ran with the first tiers)."""
    first = with_tiers(CASE, saved[0], saved[1])
    second = with_tiers(CASE, resumed[0], resumed[1])

    def body(comm: Communicator) -> None:
        straight = build_engine(first, comm, saved[2])
        run_steps(straight, first, comm, 0, 2)
        straight.save(tmp_path / "ckpt")
        expected_losses = run_steps(straight, first, comm, 2, 2)
        expected = straight.full_state_dict()
        straight.close()
        engine = build_engine(second, comm, resumed[2])
        engine.load(tmp_path / "ckpt")
        assert run_steps(engine, second, comm, 2, 2) == expected_losses
        state = engine.full_state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        engine.close()

    run_simulated(world, body)


def test_gathered_parameters_modify_reaches_disk_masters() -> None:
    """Writing a parameter inside gathered_parameters(modify=True) changes the disk-tier
    master (and, at stage 3, the disk-tier parameter shard)."""
    case = with_tiers(CASE, "disk", "disk")

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3)
        run_steps(engine, case, comm, 0, 1)
        layer = engine.module.layers[0]  # type: ignore[index]
        with engine.gathered_parameters([layer.weight], modify=True), torch.no_grad():
            layer.weight.fill_(0.25)
        state = engine.full_state_dict()
        assert torch.equal(
            state["layers.0.weight"], torch.full_like(state["layers.0.weight"], 0.25)
        )
        with engine.gathered_parameters([layer.weight]):
            assert torch.equal(layer.weight.float(), torch.full_like(layer.weight.float(), 0.25))
        engine.close()

    run_simulated(2, body)


@pytest.mark.parametrize("optimizer", ["none", "cpu", "disk"])
def test_a_save_writes_each_tile_without_joining_them(
    optimizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save streams the master and every optimizer state tile by tile: it never joins a
    group's tiles into one tensor (that was a whole copy of the shard, on the device where
    the states live), and the file holds what the joined tensors would."""
    from safetensors.torch import load_file

    case = with_tiers(CASE, optimizer, "none")

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        run_steps(engine, case, comm, 0, 2)
        state = engine.sharded_state()
        assert max(len(group.master_tiles) for group in state.groups) > 1  # tiles to join
        expected = {}
        for g, group in enumerate(state.groups):
            tiles = [tile.reshape(-1) for tile, _ in group.master_tiles]
            expected[f"master.{g}"] = torch.cat(tiles)
            for key in ("exp_avg", "exp_avg_sq"):
                parts = [s[key].reshape(-1) for s in group.tile_states]
                expected[f"state.{g}.{key}"] = torch.cat(parts)
        del state

        def joined(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the save joined tiles into one tensor")

        with monkeypatch.context() as patch:
            patch.setattr(torch, "cat", joined)
            folder = engine.save(tmp_path / "ckpt")
        saved = load_file(folder / "rank-00000.safetensors")
        for name, value in expected.items():
            assert torch.equal(saved[name], value), name
        engine.close()

    run_simulated(1, body)
