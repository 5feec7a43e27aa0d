"""Every process of a test run computes with one intra-op thread count.

A bitwise comparison between the test process and a rank holds only at equal thread counts
(MKL on Intel CPUs gives other bits at 1 and 2 threads). The root conftest.py pins the count
(OMP_NUM_THREADS, else 1) and run_on_ranks passes it on; these tests fail if either side
computes with another count, on any CPU, whether or not its arithmetic would differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import rank_bodies
import torch

from zero_comm.determinism import current_fingerprint, fingerprint_differences
from zero_comm.testing import RanksFailed, run_on_ranks
from zero_comm.testing.threads import pin_test_threads, threads_for_tests


@pytest.fixture
def other_thread_count() -> Iterator[int]:
    """The test process switched to a thread count other than the run's, then restored."""
    pinned = torch.get_num_threads()
    other = 2 if pinned == 1 else 1
    pin_test_threads(other)
    yield other
    pin_test_threads(pinned)


def test_the_test_process_computes_with_the_pinned_count() -> None:
    assert torch.get_num_threads() == threads_for_tests()
    assert (
        os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == str(threads_for_tests())
    )


@pytest.mark.gloo
def test_ranks_compute_with_the_callers_count() -> None:
    for report in run_on_ranks(rank_bodies.thread_count, 2):
        count = torch.get_num_threads()
        assert report["value"] == {"torch": count, "OMP_NUM_THREADS": str(count),
                                   "MKL_NUM_THREADS": str(count)}  # fmt: skip


@pytest.mark.gloo
def test_ranks_follow_the_caller_when_it_changes_its_count(other_thread_count: int) -> None:
    reports = run_on_ranks(rank_bodies.thread_count, 2)
    assert [r["value"]["torch"] for r in reports] == [other_thread_count] * 2


@pytest.mark.gloo
def test_a_rank_that_computes_with_another_count_fails_the_run() -> None:
    """The harness compares each rank's fingerprint after its body with the caller's."""
    with pytest.raises(RanksFailed, match=r"threads per rank \d+ here, \d+ on the rank"):
        run_on_ranks(rank_bodies.change_thread_count, 2)


def test_a_child_process_that_pins_computes_with_the_run_count() -> None:
    """Savers and fault ranks started with subprocess call pin_test_threads() first: the
    variable alone is not enough, torch caps OMP_NUM_THREADS at the cores it sees."""
    code = ("import torch; from zero_comm.testing.threads import pin_test_threads; "
            "pin_test_threads(); print(torch.get_num_threads())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == torch.get_num_threads()


def test_a_child_under_another_count_has_another_fingerprint(other_thread_count: int) -> None:
    """The fingerprint sees the thread count, so a comparison under another count is named."""
    code = ("import json, torch; from zero_comm.determinism import current_fingerprint; "
            f"torch.set_num_threads({other_thread_count + 1}); "
            "print(json.dumps(current_fingerprint().to_json()))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    differences = fingerprint_differences(current_fingerprint(), json.loads(out.stdout))
    assert [(d.field, d.before, d.now) for d in differences] == [
        ("intra_op_threads", other_thread_count, other_thread_count + 1)
    ]


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_wrong_thread_variable_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=r"OMP_NUM_THREADS=.*positive whole number"):
        threads_for_tests()
