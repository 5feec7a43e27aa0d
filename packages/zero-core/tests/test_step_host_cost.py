"""The host's work in step() grows linearly with the buckets, and reads the device once.

Found on an H200 (docs/benchmarks/gpu.md): stage 2's step of GPT-2 XL took 527 ms against
stage 0's 77 ms. Handing each of ~290 tiles to the parameters scanned every bucket (and
recomputed each bucket's size), 84,100 iterations of Python per step; and the finiteness
check read one flag per gradient chunk, 551 host-device synchronisations per step. On a
CPU neither shows in a time, so these tests count: Python calls (sys.setprofile) at two
model sizes, and ``Tensor.__bool__`` reads.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from parity import DTYPES, ParityCase, build_engine, loss_of, micro_batch

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
    assert not all_finite(tensors, chunk_numel=3)
    tensors[4][9] = 1.0
    tensors[0][0] = float("-inf")
    assert not all_finite(tensors, chunk_numel=3)
    assert all_finite([], chunk_numel=3)
