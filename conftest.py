"""Loaded by every pytest run of this repository, whichever test folder it names.

Every process of a test run computes with one intra-op thread count (see
zero_comm.testing.threads): bitwise comparisons between the test process and the ranks,
savers and trainers it starts hold only then.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from zero_comm.testing.threads import pin_test_threads

REPOSITORY = Path(__file__).resolve().parent

# No per-example deadline: on a shared 2-core machine one example of a pure function took
# 569 ms once and 4.5 ms when hypothesis retried it (a FlakyFailure). A deadline measures
# the machine's load, not the code; every test has pytest-timeout's bound instead.
settings.register_profile("zero", deadline=None)
settings.load_profile("zero")


def pytest_configure(config: pytest.Config) -> None:
    pin_test_threads()


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    return f"intra-op threads per process: {torch.get_num_threads()} (OMP_NUM_THREADS)"


@pytest.fixture(autouse=True)
def _run_from_an_empty_folder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test runs from an empty working directory of its own, so none depends on what
    the folder pytest was started from holds: the quick start's runs/zero-train, left there
    by ``./nox -s train``, once made two option tests see "another run's results". Tests
    name the files they read from their own location (``Path(__file__)``)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def tool_env() -> dict[str, str]:
    """The environment of a process that runs one of tools/ as a module (``python -m
    tools.peers.bench``) from a test's empty folder: this process's, with the repository first
    on PYTHONPATH, where ``python -m`` and the tool's own ``from tools...`` imports find the
    package (from the repository root they find it in the working folder)."""
    path = [str(REPOSITORY), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
