"""The library logger ``zero_core`` is silent unless the application configures logging
(a NullHandler), and at DEBUG each offload tier says what it built when it is set up: the
swap folder, its tiles and their sizes, the I/O threads. Nothing is logged per step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from parity import ParityCase, build_engine, normalised
from test_checkpoint import run_steps

import zero_core
from zero_comm import Communicator, run_simulated

CASE = normalised(
    ParityCase(widths=(5, 130, 7), vocab=11, tie=True, bucket_numel=300, persistence_threshold=0)
)
DISK = {"offload_optimizer": "disk", "offload_params": "disk", "offload_sub_group_numel": 64}


def test_the_package_logger_has_a_null_handler() -> None:
    logger = logging.getLogger("zero_core")
    assert zero_core.__name__ == logger.name
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_each_offload_tier_says_what_it_built_at_debug(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    settings = {**DISK, "offload_dir": str(tmp_path), "offload_io_threads": 3}
    engines: list[zero_core.ZeroEngine] = []

    def build(comm: Communicator) -> None:
        engines.append(build_engine(CASE, comm, 3, settings))

    with caplog.at_level(logging.DEBUG, logger="zero_core"):
        run_simulated(1, build)
    built = [r.getMessage() for r in caplog.records if r.name == "zero_core.offload.build"]
    masters = next(m for m in built if "offloaded masters" in m)
    assert "offload_optimizer=disk" in masters and "disk: " in masters and " tiles, " in masters
    pipeline = next(m for m in built if "master swap pipeline" in m)
    folder = engines[0].masters.swap.folder  # type: ignore[union-attr]
    assert f"folder {folder}" in pipeline and "3 I/O threads" in pipeline
    shards = next(m for m in built if "parameter shards swapped" in m)
    assert f"folder {folder}" in shards and "3 I/O threads" in shards
    assert any("swap files need" in m and str(tmp_path) in m for m in built)

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="zero_core"):
        run_simulated(1, lambda comm: run_steps(engines[0], CASE, comm, 0, 2))
    assert not [r for r in caplog.records if r.name.startswith("zero_core")], "a step logs nothing"
    engines[0].close()


def test_at_info_the_tiers_say_nothing(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    settings = {**DISK, "offload_dir": str(tmp_path)}
    with caplog.at_level(logging.INFO, logger="zero_core"):
        run_simulated(1, lambda comm: build_engine(CASE, comm, 3, settings).close())
    assert not [r for r in caplog.records if r.name == "zero_core.offload.build"]
