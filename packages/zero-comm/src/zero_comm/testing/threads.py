"""One intra-op thread count for every process of a test run.

A bitwise comparison between two processes holds only if both ran with the same number of
intra-op threads (MKL on Intel gives other bits for a matmul at 1 and 2 threads; see
zero_comm.determinism). So the test process and everything it starts use one count:

    OMP_NUM_THREADS unset      1 thread per process (distributed tests oversubscribe cores)
    OMP_NUM_THREADS=n          n threads per process, on both sides of every comparison

:func:`pin_test_threads` (called once, by the root conftest.py) sets torch's count in the
test process and writes it to ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for its children.
The variables alone do not fix a child's count: torch caps them at the cores it sees
(``OMP_NUM_THREADS=4`` gives 2 threads on a 2-core machine), so every child calls
:func:`pin_test_threads` too. :func:`zero_comm.testing.run_on_ranks` does it for each rank
and fails a run whose ranks ended with another count than the caller's; zero-train sets its
count from ``OMP_NUM_THREADS`` explicitly.
"""

from __future__ import annotations

import os

import torch

DEFAULT_TEST_THREADS = 1
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def threads_for_tests() -> int:
    """The count asked for: OMP_NUM_THREADS if set (a positive integer), else 1."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return DEFAULT_TEST_THREADS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS={value!r}: the test run needs a positive whole number of threads "
            "per process; unset it for 1"
        )
    return int(value)


def pin_test_threads(threads: int | None = None) -> int:
    """Fix this process's intra-op threads, and its children's, to ``threads`` (default
    :func:`threads_for_tests`); returns the count."""
    count = threads_for_tests() if threads is None else threads
    for name in THREAD_VARIABLES:
        os.environ[name] = str(count)
    torch.set_num_threads(count)
    return count
