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
from zero_core import gradient_checks
from zero_core.gradient_checks import divide_and_check_finite


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


def test_the_finite_check_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = 0
    original = torch.Tensor.__bool__

    def counting(self: torch.Tensor) -> bool:
        nonlocal reads
        reads += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    monkeypatch.setattr(gradient_checks, "CACHE_PIECE_NUMEL", 4)  # several pieces a tensor
    tensors = [torch.ones(10) for _ in range(5)]
    assert divide_and_check_finite(tensors, 1.0, chunk_numel=3)
    assert reads == 1
    tensors[4][9] = float("nan")  # the last element of the last chunk
    reads = 0
    assert not divide_and_check_finite(tensors, 1.0, chunk_numel=3)
    assert reads == 2  # the sums, then the exact check
    tensors[4][9] = 1.0
    tensors[0][0] = float("-inf")
    assert not divide_and_check_finite(tensors, 1.0, chunk_numel=3)
    assert divide_and_check_finite([], 1.0, chunk_numel=3)


class _FullReads(TorchDispatchMode):
    """Records the ATen operators that take a tensor of at least ``numel`` elements and
    compute (views, which read nothing, are left out)."""

    VIEWS = frozenset({"view", "split", "_reshape_alias", "reshape", "alias"})

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        leaves = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name not in self.VIEWS and any(a.numel() >= self.numel for a in leaves):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_finite_data_is_divided_and_read_once() -> None:
    """Finite gradients, the case of every step, are divided and then read by one sum per
    piece, not by isfinite (abs, ne, eq, mul: four passes and three temporaries, two thirds
    of stage 0's step)."""
    tensors = [torch.randn(1000) for _ in range(3)]
    with _FullReads(1000) as mode:
        assert divide_and_check_finite(tensors, 2.0, chunk_numel=4096)
    assert mode.ops == ["div_", "sum"] * 3, mode.ops


def test_a_non_contiguous_tensor_is_refused_not_divided_as_a_copy() -> None:
    """Dividing a flattened copy would leave the gradient undivided, silently."""
    grid = torch.ones(4, 6)
    with pytest.raises(RuntimeError):
        divide_and_check_finite([grid.t()], 2.0, chunk_numel=4)
    assert torch.equal(grid, torch.ones(4, 6))


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.sampled_from(
            [
                0.0,
                -0.0,
                1.0,
                -2.5,
                3e38,
                -3e38,
                6e4,
                1e-45,
                float("inf"),
                float("-inf"),
                float("nan"),
            ]
        ),
        min_size=1,
        max_size=40,
    ),
    cut=st.integers(1, 40),
    chunk=st.integers(1, 16),
    piece=st.integers(1, 16),
    denominator=st.sampled_from([1.0, 2.0, 3.0, 0.5, 1e-30, 4096.0]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_divide_and_check_finite_is_exact(
    values: list[float], cut: int, chunk: int, piece: int, denominator: float, dtype: torch.dtype
) -> None:
    """The bits of dividing each tensor whole, and isfinite's answer on them, also where
    finite values overflow the sum (3e38 + 3e38 in float32, 6e4 + 6e4 in float16), where
    the division overflows (by 1e-30), and where +Inf and -Inf cancel to NaN; for any
    split into pieces."""
    tensors = [torch.tensor(values[:cut], dtype=dtype), torch.tensor(values[cut:], dtype=dtype)]
    expected_values = [t / denominator for t in tensors]
    expected = all(bool(torch.isfinite(t).all()) for t in expected_values)
    saved = gradient_checks.CACHE_PIECE_NUMEL
    gradient_checks.CACHE_PIECE_NUMEL = piece
    try:
        assert divide_and_check_finite(tensors, denominator, chunk_numel=chunk) == expected
    finally:
        gradient_checks.CACHE_PIECE_NUMEL = saved
    # NaN's sign and payload bits are not specified by the division (a vectorised and a
    # scalar loop may differ, seen once in bfloat16): a NaN must stay a NaN, every other
    # value keeps its bits. A step that sees a NaN is skipped whatever its bits.
    for got, want in zip(tensors, expected_values, strict=True):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        keep = ~torch.isnan(want)
        assert torch.equal(got[keep].view(torch.uint8), want[keep].view(torch.uint8))
