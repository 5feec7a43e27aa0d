"""zero-estimate reproduces the fits of the offload papers, and its offload terms (gradients
in the optimizer's tier, the device's working memory, the bytes per link) hold as properties.

The papers' claims, and what each test assumes where the paper leaves a number open:

    ZeRO-Offload (Ren et al. 2021): 13B parameters train on one 32 GB V100 with the
        optimizer on the CPU (stage 2, fp16): the device keeps 2 bytes per parameter; each
        step moves 2Ψ/N of gradients down and 2Ψ/N of parameters up (4Ψ/N).
        Assumed shape: 40 layers, width 5120, 40 heads, GPT-2's 50257 tokens (12 L C^2 + V C
        = 12.8e9), one sequence of 1024 tokens per micro-step, full activation checkpointing.
    ZeRO-Infinity (Rajbhandari et al. 2021): 1T parameters train on one DGX-2 (16 x 32 GB
        V100) with everything on NVMe (stage 3): the device keeps working memory only.
        Assumed shape: the paper's 1T row, 128 layers of width 25600 (12 L C^2 = 1.007e12),
        256 heads, 1024 tokens per micro-step, full activation checkpointing (kept on the
        device: the paper offloads them too, so this is the harder case); the largest unit
        is the MLP's 25600 x 102400 linear layer (its fp16 parameter and gradient, 10.5 GB,
        are the paper's "model state working memory"); the engine's default prefetch,
        backward head, buckets in flight and coalesced gathers.

"32 GB" is taken as 32e9 bytes (a V100 has 32 GiB = 34.4e9: the tests leave that margin).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_core.estimate.command import main
from zero_core.estimate.model_states import tiered_state_bytes
from zero_core.estimate.offload_traffic import offload_traffic
from zero_core.estimate.working_set import transformer_largest, working_bytes

V100 = 32e9
GPT2_VOCAB = 50257


def estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    main([*argv, "--json"])
    rows: dict[str, Any] = json.loads(capsys.readouterr().out)
    return rows


def shape(layers: int, width: int, heads: int) -> list[str]:
    sizes = {"layers": layers, "width": width, "heads": heads, "vocab-size": GPT2_VOCAB,
             "tokens": 1024}  # fmt: skip
    return [*(f"--{k}={v}" for k, v in sizes.items()), "--checkpoint", "full"]


def test_zero_offload_13b_fits_one_32gb_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 2, fp16, optimizer on the CPU, one GPU: 2 bytes per parameter of model states
    on the device (26 GB) and one reduction's gradient slice landed before its copy out
    (the largest: the 50257 x 5120 embedding's, 0.5 GB), under 2 GB of working memory and
    activations on top:
    fits in 32 GB. With the gradients kept on the device (what the engine did before
    issue 48) it is 52 GB and does not fit. Over PCIe: 2Ψ down, 2Ψ up per step."""
    psi = 13e9
    argv = ["--params", "13e9", "--world-size", "1", "--dtype", "fp16", "--offload-optimizer",
            "cpu", *shape(40, 5120, 40)]  # fmt: skip
    row = estimate(capsys, *argv)["2"]
    embedding = GPT2_VOCAB * 5120
    assert row["device"] == 2 * psi + 2 * embedding
    assert row["gradients_tier"] == "cpu" and row["tier_gradients"] == 2 * psi
    assert row["host"] == (4 + 8 + 2) * psi  # master, Adam's two moments, fp16 gradient
    assert row["working"] + row["activations_peak"] < 2e9
    assert row["step_peak"] < V100
    links = row["links"]
    assert links["device_to_host"] == {"gradients": 2 * psi, "parameters": 0.0,
                                       "optimizer_states": 0.0, "total": 2 * psi}  # fmt: skip
    assert links["host_to_device"]["total"] == links["host_to_device"]["parameters"] == 2 * psi
    assert links["disk_to_host"]["total"] == links["host_to_disk"]["total"] == 0
    kept = estimate(capsys, *argv, "--no-offload-gradients")["2"]
    assert kept["device"] == 4 * psi and kept["step_peak"] > V100
    assert kept["step_peak"] - row["step_peak"] == 2 * psi - 2 * embedding
    # Without a shape the row is the command: 26 GB and the bucket buffers.
    plain = estimate(capsys, *argv[:8])["2"]
    assert plain["device"] == 26e9 + 2 * 2**22  # + one landed bucket slice (N = 1: a bucket)
    assert plain["device_peak"] == plain["device"] + plain["working"]
    # (2 in flight + 1) x bucket x (staging, receive rows, slice) x fp16 x pool's size class
    assert plain["working"] == 3 * 2**22 * 3 * 2 * (1 + 1 / 8)


def test_zero_infinity_1t_fits_sixteen_32gb_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 3 on 16 GPUs, masters, states, gradients and parameters on disk: no model
    state stays on the device but the landed slice of one reduction; the working memory
    is the largest unit's parameter and gradient (2 x 2 x 4 x 25600^2 bytes, the paper's
    model state working memory) plus the configured buffers; with the activations the
    step fits in 32 GB. Keeping the gradients on the device (before issue 48) puts
    2Ψ/N = 125 GB there."""
    psi, n = 1e12, 16
    argv = ["--params", "1e12", "--world-size", "16", "--dtype", "fp16", "--offload-optimizer",
            "disk", "--offload-params", "disk", *shape(128, 25600, 256)]  # fmt: skip
    row = estimate(capsys, *argv)["3"]
    largest_op = 4 * 25600 * 25600
    assert row["device"] == 2 * largest_op / n  # its gradient's slice, landed for its copy
    assert row["disk"] == pytest.approx((2 + 4 + 8 + 2) * psi / n)
    parts = row["working_parts"]
    assert parts["autograd_gradient"] == 2 * largest_op
    assert 2 * largest_op <= parts["gathered_units"] <= 2 * largest_op * 1.01
    assert row["working"] < 2 * 2 * largest_op * 1.02  # + buckets, prefetch, coalescing
    assert row["step_peak"] < V100
    assert row["host"] < 1e9  # host memory: only the disk pipeline's buffers
    kept = estimate(capsys, *argv, "--no-offload-gradients")["3"]
    assert kept["device"] == pytest.approx(2 * psi / n) and kept["step_peak"] > V100
    # NVMe per rank and step: masters and states read and written whole, fp16
    # gradients written once and read twice (the non-finite check, then the step), each
    # parameter shard read for forward (and for backward where forward did not keep it)
    # and written once.
    links = row["links"]
    assert links["host_to_disk"]["optimizer_states"] == pytest.approx(12 * psi / n)
    assert links["disk_to_host"]["gradients"] == pytest.approx(2 * 2 * psi / n)
    assert links["host_to_disk"]["gradients"] == pytest.approx(2 * psi / n)
    assert links["host_to_disk"]["parameters"] == pytest.approx(2 * psi / n)
    reads = links["disk_to_host"]["parameters"]
    assert 2 * psi / n < reads <= 4 * psi / n


@given(st.integers(1, 10**12), st.integers(1, 4096), st.sampled_from([2, 4]),
       st.sampled_from(["cpu", "disk"]), st.integers(1, 8))  # fmt: skip
def test_zero_offload_moves_2_psi_over_n_each_way(
    psi: int, n: int, width: int, tier: str, accumulation: int
) -> None:
    """Stage 2, whole optimizer offloaded: each micro-step sends its gradient slice down
    (g Ψ/N, A times), the step sends the updated parameter slice up (p Ψ/N); gradients
    kept on the device go down once, at the step. A = 1, fp16: the paper's 4Ψ/N."""
    common: dict[str, Any] = {
        "param_bytes": width, "grad_bytes": width, "state_bytes": 8, "offload_optimizer": tier,
        "accumulation_steps": accumulation,
    }  # fmt: skip
    moved = offload_traffic(psi, n, 2, offload_gradients=True, **common)
    assert moved.device_to_host.gradients == pytest.approx(accumulation * width * psi / n)
    assert moved.host_to_device.parameters == pytest.approx(width * psi / n)
    assert moved.device_to_host.parameters == moved.host_to_device.gradients == 0
    kept = offload_traffic(psi, n, 2, offload_gradients=False, **common)
    assert kept.device_to_host.gradients == pytest.approx(width * psi / n)
    on_disk = tier == "disk"
    assert moved.disk_to_host.optimizer_states == pytest.approx(12 * psi / n if on_disk else 0)
    assert moved.host_to_disk.gradients == pytest.approx(
        accumulation * width * psi / n if on_disk else 0
    )
    assert moved.disk_to_host.gradients == pytest.approx(
        (accumulation + 1) * width * psi / n if on_disk else 0  # + the non-finite check
    )
    assert kept.host_to_disk.gradients == 0  # on the device: they never reach the disk
    clipped = offload_traffic(psi, n, 2, offload_gradients=True, clipping=True, **common)
    assert clipped.host_to_device.gradients == pytest.approx(width * psi / n)  # the norm
    assert clipped.disk_to_host.gradients - moved.disk_to_host.gradients == pytest.approx(
        width * psi / n if on_disk else 0
    )
    if accumulation == 1 and width == 2:
        assert moved.device_to_host.total + moved.host_to_device.total == pytest.approx(4 * psi / n)


@given(st.integers(0, 10**12), st.integers(1, 4096), st.sampled_from(["cpu", "disk"]),
       st.sampled_from([0.0, 0.5, 1.0]), st.integers(2, 3))  # fmt: skip
def test_gradients_follow_the_optimizers_tier(
    psi: int, n: int, tier: str, fraction: float, stage: int
) -> None:
    """Stages 2, 3: the offloaded fraction's gradient slice leaves the device for the tier
    (in its dtype, 2 bytes here), but for one reduction's slice (a bucket's, 2^22 / N
    elements padded to 128, or the whole offloaded part if smaller) landed before its copy;
    the rest stays; nothing else moves. Stage 1 keeps its full gradient buffers."""
    args: dict[str, Any] = {"offload_optimizer": tier, "offload_fraction": fraction}
    follow = tiered_state_bytes(psi, n, stage, offload_gradients=True, **args)
    stay = tiered_state_bytes(psi, n, stage, offload_gradients=False, **args)
    shard = psi / n
    landed = min(shard * fraction, -(-(2**22) // (128 * n)) * 128)
    assert follow.gradients == pytest.approx(2 * (shard * (1 - fraction) + landed))
    assert follow.tier_gradients == pytest.approx(2 * shard * fraction)
    held = follow.host if tier == "cpu" else follow.disk
    assert held == pytest.approx((stay.host if tier == "cpu" else stay.disk) + 2 * shard * fraction)
    assert follow.model_states == pytest.approx(stay.model_states + 2 * landed)
    assert follow.parameters == stay.parameters
    assert follow.optimizer_states == stay.optimizer_states
    stage1 = tiered_state_bytes(psi, n, 1, offload_gradients=True, **args)
    assert stage1 == tiered_state_bytes(psi, n, 1, offload_gradients=False, **args)


@given(st.integers(1, 4096), st.sampled_from([2**10, 2**22]), st.integers(1, 4),
       st.sampled_from([0, 2**20, 2**30]))  # fmt: skip
def test_working_memory_is_set_by_the_configuration(
    n: int, bucket: int, in_flight: int, largest: int
) -> None:
    """Stages 2, 3: M + 1 buckets with their reduced slices, and the largest parameter's
    gradient; stage 3 adds the largest unit with what is gathered ahead; stages 0, 1
    none (their full gradient buffers are model states). Nothing depends on Ψ."""
    common: dict[str, Any] = {
        "param_bytes": 2, "grad_bytes": 2, "bucket_numel": bucket,
        "max_buckets_in_flight": in_flight, "largest_param_numel": largest,
        "largest_unit_numel": largest, "prefetch_numel": 2**22, "backward_head_numel": 2**24,
        "gather_coalesce_numel": 2**18,
    }  # fmt: skip
    assert working_bytes(0, n, **common).total == working_bytes(1, n, **common).total == 0
    two = working_bytes(2, n, **common)
    assert two.gradient_buckets == pytest.approx(
        (in_flight + 1) * bucket * (2 + 1 / n) * 2 * (1 + 1 / 8)
    )
    assert two.autograd_gradient == 2 * largest and two.gathered_units == 0
    three = working_bytes(3, n, **common)
    assert three.gathered_units == 2 * (largest + 2**24)  # the backward head is the larger
    assert three.total > two.total


def test_a_transformers_largest_unit_is_its_embedding_or_its_mlp() -> None:
    assert transformer_largest(50257, 768) == (50257 * 768, 50257 * 768)
    assert transformer_largest(50257, 25600) == (4 * 25600**2, 4 * 25600**2 + 4 * 25600)
    assert transformer_largest(50257, 25600, tp=2) == (2 * 25600**2, 2 * 25600**2 + 2 * 25600)
