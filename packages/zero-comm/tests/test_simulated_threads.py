"""A simulated rank computes with the caller's intra-op thread count from its first kernel.

A new thread starts with OpenMP's and MKL's defaults; torch applies ``set_num_threads`` to
a thread only at its first parallel kernel. A rank whose first matmul ran with MKL's
default of one thread per core gave other bits than the same matmul later (found by the
stage parity property: a float32 layer of width 130 differed by one ulp in the first of two
runs on the same ranks).
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from zero_comm import run_simulated


def mkl_threads_function() -> ctypes._CFuncPtr | None:
    """MKL's count for the calling thread, from the MKL linked into torch (None without)."""
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(library).mkl_get_max_threads
    except (OSError, AttributeError):
        return None


def count_in_a_bare_thread(count: ctypes._CFuncPtr) -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(count()))
    thread.start()
    thread.join()
    return seen[0]


def test_every_rank_matmuls_with_the_callers_thread_count() -> None:
    count = mkl_threads_function()
    if count is None:
        pytest.skip("torch is not built with MKL: no per-thread MKL count to read")
    default = count_in_a_bare_thread(count)
    wanted = 2 if default == 1 else 1  # differs from what a bare thread would get
    before = torch.get_num_threads()
    torch.set_num_threads(wanted)
    try:
        # The check can fail: a thread of our own, started the same way, gets the default.
        assert count_in_a_bare_thread(count) == default != wanted
        assert run_simulated(3, lambda comm: count()) == [wanted] * 3
    finally:
        torch.set_num_threads(before)


def test_a_ranks_first_matmul_equals_the_callers() -> None:
    """The shape that showed the bug on AVX2 MKL: (5, 4) @ (4, 130)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(4, 5, generator=generator).t()
    b = torch.randn(4, 130, generator=generator)
    expected = a @ b
    assert all(torch.equal(r, expected) for r in run_simulated(2, lambda comm: a @ b))
