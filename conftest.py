"""Loaded by every pytest run of this repository, whichever test folder it names.

Every process of a test run computes with one intra-op thread count (see
zero_comm.testing.threads): bitwise comparisons between the test process and the ranks,
savers and trainers it starts hold only then.
"""

from __future__ import annotations

import pytest

from zero_comm.testing.threads import pin_test_threads


def pytest_configure(config: pytest.Config) -> None:
    pin_test_threads()


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    return f"intra-op threads per process: {torch.get_num_threads()} (OMP_NUM_THREADS)"
