"""The host's work in step() grows linearly with the buckets, and reads the device once.

Found on an H200 (docs/benchmarks/gpu.md): stage 2's step of GPT-2 XL took 527 ms against
stage 0's 77 ms. Handing each of ~290 tiles to the parameters scanned every bucket (and
recomputed each bucket's size), 84,100 iterations of Python per step; and the finiteness
check read one flag per gradient chunk, 551 host-device synchronisations per step. On a
CPU neither shows in a time, so these tests count: Python calls (sys.setprofile) at two
model sizes, and ``Tensor.__bool__`` reads.

The finiteness check itself was two thirds of stage 0's step on a CPU (isfinite reads each
gradient four times): the fast path is one sum per tensor, checked here by the operators it
dispatches and, for exactness, against isfinite.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import DTYPES, ParityCase, build_engine, loss_of, micro_batch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_comm import Communicator, run_simulated
from zero_core.gradient_checks import all_finite


def calls_in_step(layers: int, stage: int) -> tuple[int, int]:
    """(Python calls made by one engine.step(), buckets) for ``layers`` 8 x 8 layers in
    buckets of 64 elements, bfloat16 (so the masters are separate and handed over)."""
    case = ParityCase(widths=(8,) * (layers + 1), dtype="bfloat16", bucket_numel=64, steps=1)

    def body(comm: Communicator) -> tuple[int, int]:
        engine = build_engine(case, comm, stage)
        x, target = micro_batch(case, 0)
        engine.backward(loss_of(case, engine(x.to(DTYPES[case.dtype])), target))
        count = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal count
            if event in ("call", "c_call"):
                count += 1

        sys.setprofile(profile)
        try:
            engine.step()
        finally:
            sys.setprofile(None)
        buckets = sum(len(layout.buckets) for layout in engine.layouts)
        engine.close()
        return count, buckets

    return run_simulated(1, body)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_host_work_grows_linearly_with_the_buckets(stage: int) -> None:
    small, small_buckets = calls_in_step(10, stage)
    large, large_buckets = calls_in_step(120, stage)
    assert large_buckets >= 10 * small_buckets
    ratio, buckets_ratio = large / small, large_buckets / small_buckets
    # Linear: calls grow like the buckets (ratio ~ buckets_ratio); the quadratic scan
    # made it ~ buckets_ratio squared.
    assert ratio < 2 * buckets_ratio, (
        f"stage {stage}: {small} calls for {small_buckets} buckets, {large} for "
        f"{large_buckets}: x{ratio:.1f} for x{buckets_ratio:.1f} buckets"
    )


def test_all_finite_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0
    original = torch.Tensor.__bool__

    def counting(self: torch.Tensor) -> bool:
        nonlocal reads
        reads += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    tensors = [torch.ones(10) for _ in range(5)]
    assert all_finite(tensors, chunk_numel=3)
    assert reads == 1
    tensors[4][9] = float("nan")  # the last element of the last chunk
    reads = 0
    assert not all_finite(tensors, chunk_numel=3)
    assert reads == 2  # the sums, then the exact check
    tensors[4][9] = 1.0
    tensors[0][0] = float("-inf")
    assert not all_finite(tensors, chunk_numel=3)
    assert all_finite([], chunk_numel=3)


class _FullReads(TorchDispatchMode):
    """Records the ATen operators that take a tensor of at least ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        leaves = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if any(a.numel() >= self.numel for a in leaves):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_all_finite_reads_finite_data_once() -> None:
    """Finite gradients, the case of every step, are read by one sum each, not by isfinite
    (abs, ne, eq, mul: four passes and three temporaries, two thirds of stage 0's step)."""
    tensors = [torch.randn(1000) for _ in range(3)]
    with _FullReads(1000) as mode:
        assert all_finite(tensors, chunk_numel=4096)
    assert mode.ops == ["sum", "sum", "sum"], mode.ops


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.sampled_from(
            [0.0, 1.0, -2.5, 3e38, -3e38, 6e4, float("inf"), float("-inf"), float("nan")]
        ),
        min_size=1,
        max_size=40,
    ),
    cut=st.integers(1, 40),
    chunk=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_all_finite_is_exact(values: list[float], cut: int, chunk: int, dtype: torch.dtype) -> None:
    """The answer is isfinite's, also where finite values overflow the sum (3e38 + 3e38 in
    float32, 6e4 + 6e4 in float16) and where +Inf and -Inf cancel to NaN."""
    tensors = [torch.tensor(values[:cut], dtype=dtype), torch.tensor(values[cut:], dtype=dtype)]
    expected = all(bool(torch.isfinite(t).all()) for t in tensors)
    assert all_finite(tensors, chunk_numel=chunk) == expected
