"""The papers' published results, predicted by the cost model (issue 51, point 4).

    python -m zero_core.plan.papers              # the table: published, predicted, error
    python -m zero_core.plan.papers --json       # the same as JSON

For every row of :data:`~zero_core.plan.paper_results.RESULTS` the paper's setup becomes a
:class:`~zero_core.plan.workload.Workload`, a :class:`~zero_core.plan.configuration.PlanConfig`
and a :class:`~zero_core.plan.cluster.Cluster` from :mod:`~zero_core.plan.paper_presets`,
and :func:`zero_core.plan.step_time.predict` gives the step; a throughput row is the
papers' FLOP count (``paper_results.megatron_flops``) over the predicted step and the GPUs,
a speed-up row the ratio of two predicted steps' throughputs.

One fitted number per GPU kind. ``compute_efficiency`` (achieved / peak FLOP/s of the
matmuls) is the only number not read from a source. :func:`fit_efficiency` fits it once for
the V100 (every paper row runs on V100s: the ZeRO, ZeRO-Offload and ZeRO++ DGX-2s and
MiCS's p3dn.24xlarge), minimising the mean squared log error of the absolute-throughput
rows marked ``fit`` (a row stating a lower bound counts only when predicted under it).
Speed-up rows are never fitted: they are predictions.

Two things the cost model has no term for, and how the rows stand in for them (both
named in the report of issue 51 as model gaps, not tuned here):

- Tensor (Megatron) parallelism. zero-plan plans data parallelism over every device. A
  row with model parallelism of degree t inside a node is run as data parallelism over
  "super-devices" of t GPUs (t x the peak FLOP/s, memory and memory bandwidth; a node of
  16 GPUs with t = 16 is one such device), which splits the model states and compute as
  Megatron does but omits its activation all-reduces inside the node. Its micro-batch
  is the largest that fits one real GPU (``plan.memory.memory_bytes`` with tp = t on
  Psi / t parameters: the GPU's slice of the model states, P_a-partitioned checkpoints).
- DeepSpeed's own kernels and schedules: the rows predict *our* engine on the papers'
  hardware, with the papers' configurations (fp16, gradients reduced in fp16, buckets as
  the papers' configs give them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .cluster import Cluster
from .configuration import PlanConfig
from .memory import memory_bytes
from .paper_presets import GPU_KIND, PAPER_PRESETS, nccl_ring_step_latency
from .paper_results import RESULTS, PaperModel, PaperSetup, PublishedResult, megatron_flops
from .step_time import Prediction, predict
from .workload import Workload

# Gradient buckets (elements): the ZeRO++ tutorial's reduce_bucket_size, 1e7, for the
# ZeRO++ rows (the only evaluation config of the papers' that states one); DeepSpeed's
# default, 5e8, for the others.
BUCKET_NUMEL = {"ZeRO": 500_000_000, "ZeRO-Offload": 500_000_000, "ZeRO++": 10_000_000,
                "MiCS": 500_000_000}  # fmt: skip
# Search range for the fitted efficiency.
EFFICIENCY_RANGE = (0.05, 1.0)
# Issue 51, point 4: one efficiency per GPU kind, and fitted only from at least this many
# absolute-throughput rows on it. Fewer rows would make the fit a tuned match of those
# rows, not a prediction (why MiCS's p3dn.24xlarge, one speed-up row, has no fit of its own).
MIN_FIT_ROWS = 3
MAX_MICRO_BATCH = 1024


class RowPrediction(NamedTuple):
    """One row: the published value, ours, and the relative error (ours / published - 1)."""

    result: PublishedResult
    predicted: float
    error: float
    micro_batch: int
    fits: bool
    detail: dict[str, float]

    @property
    def within_claim(self) -> bool:
        """A lower-bound row ("over 38 TFLOPS") holds if predicted at or above it."""
        return self.result.at_least and self.predicted >= self.result.value

    def as_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "key": r.key, "paper": r.paper, "claim": r.claim, "metric": r.metric,
            "published": r.value, "at_least": r.at_least, "predicted": self.predicted,
            "error": self.error, "micro_batch": self.micro_batch, "fits": self.fits,
            "fitted_row": r.fit, "source": r.source, "assumed": r.assumed,
            "detail": self.detail,
        }  # fmt: skip


def setup_cluster(setup: PaperSetup, efficiency: float) -> Cluster:
    """The preset at the setup's scale; with tensor parallelism t, super-devices of t GPUs
    (module docstring)."""
    preset = PAPER_PRESETS[setup.preset]
    if setup.gpus % preset.devices_per_node and setup.gpus > preset.devices_per_node:
        raise ValueError(
            f"{setup.preset}: {setup.gpus} GPUs are not whole nodes of "
            f"{preset.devices_per_node}; give a multiple"
        )
    per_node = min(preset.devices_per_node, setup.gpus)
    nodes = max(1, setup.gpus // per_node)
    t = setup.tensor_parallel
    if per_node % t:
        raise ValueError(f"{setup.preset}: tensor parallelism {t} does not divide a node")
    return preset.with_(
        nodes=nodes, devices_per_node=per_node // t, compute_efficiency=efficiency,
        peak_flops=preset.peak_flops * t, device_memory=preset.device_memory * t,
        memory_bandwidth=preset.memory_bandwidth * t, host_bandwidth=preset.host_bandwidth * t,
        host_optimizer_rate=preset.host_optimizer_rate * t,
        inter_latency=nccl_ring_step_latency(nodes, per_node),
    )  # fmt: skip


def setup_config(paper: str, setup: PaperSetup, cluster: Cluster) -> PlanConfig:
    """The engine configuration that matches the paper's."""
    checkpoint = "none"
    if setup.checkpointing:
        checkpoint = "partitioned" if setup.tensor_parallel > 1 else "full"
    return PlanConfig(
        stage=setup.stage, offload_optimizer=setup.offload_optimizer,
        shard_group=setup.shard_group, checkpoint=checkpoint,
        hpz=cluster.devices_per_node if setup.zeropp else 1,
        quantize_weights=setup.zeropp, quantize_gradients="int4" if setup.zeropp else None,
        bucket_numel=BUCKET_NUMEL[paper], deterministic=False,
    )  # fmt: skip


def setup_workload(model: PaperModel, setup: PaperSetup, micro_batch: int) -> Workload:
    """fp16 training (gradients reduced in fp16, as DeepSpeed does) of ``micro_batch``
    sequences per data-parallel rank (a super-device's with tensor parallelism)."""
    dp = setup.gpus // setup.tensor_parallel
    return Workload(
        params=float(model.params), layers=model.layers, width=model.width,
        heads=model.heads, vocab_size=model.vocab_size, context=model.seq_len,
        batch_size=micro_batch * dp, accumulation=setup.accumulation_steps, dtype="fp16",
        name=model.name,
    )  # fmt: skip


def gpu_fits(model: PaperModel, setup: PaperSetup, config: PlanConfig, micro_batch: int) -> bool:
    """Whether one real GPU holds the step: its Psi / t slice of the model states over the
    data-parallel ranks, its activations at tensor parallelism t, the working set."""
    t = setup.tensor_parallel
    dp = setup.gpus // t
    gpu = setup_workload(model, setup, micro_batch).with_(params=model.params / t)
    preset = PAPER_PRESETS[setup.preset]
    return memory_bytes(gpu, config, dp, tp=t).device <= preset.device_memory


def largest_micro_batch(model: PaperModel, setup: PaperSetup, config: PlanConfig) -> int:
    """The largest micro-batch one GPU holds (at least 1: a row's setup did run)."""
    if not gpu_fits(model, setup, config, 1):
        return 1
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH and gpu_fits(model, setup, config, high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gpu_fits(model, setup, config, mid) else (low, mid)
    return low


class _Step(NamedTuple):
    prediction: Prediction
    micro_batch: int
    tflops_per_gpu: float


def _step(result: PublishedResult, setup: PaperSetup, efficiency: float) -> _Step:
    cluster = setup_cluster(setup, efficiency)
    config = setup_config(result.paper, setup, cluster)
    micro = setup.micro_batch or largest_micro_batch(result.model, setup, config)
    workload = setup_workload(result.model, setup, micro)
    prediction = predict(workload, cluster, config)
    sequences = workload.batch_size * workload.accumulation
    flops = megatron_flops(result.model, sequences, setup.checkpointing)
    return _Step(prediction, micro, flops / prediction.step_s / setup.gpus / 1e12)


def predict_row(result: PublishedResult, efficiency: float) -> RowPrediction:
    """``result``'s prediction at ``efficiency`` (the module docstring)."""
    main = _step(result, result.setup, efficiency)
    detail = {"step_s": main.prediction.step_s, "tflops_per_gpu": main.tflops_per_gpu,
              "inter_node_bytes": main.prediction.inter_node_bytes}  # fmt: skip
    if result.metric == "tflops_per_gpu":
        predicted = main.tflops_per_gpu
    elif result.metric == "step_s":
        predicted = main.prediction.step_s
    else:
        if result.baseline is None:
            raise ValueError(f"{result.key}: a speed-up row needs a baseline setup")
        base = _step(result, result.baseline, efficiency)
        predicted = main.tflops_per_gpu / base.tflops_per_gpu
        detail.update(baseline_step_s=base.prediction.step_s,
                      baseline_tflops_per_gpu=base.tflops_per_gpu)  # fmt: skip
    return RowPrediction(
        result, predicted, predicted / result.value - 1, main.micro_batch,
        main.prediction.fits, detail,
    )  # fmt: skip


def _fit_loss(rows: Sequence[PublishedResult], efficiency: float) -> float:
    total = 0.0
    for row in rows:
        p = predict_row(row, efficiency)
        miss = math.log(p.predicted / row.value)
        if row.metric == "step_s":
            miss = -miss  # a longer step is a lower throughput
        if row.at_least and miss > 0:
            miss = 0.0
        total += miss * miss
    return total / max(1, len(rows))


def fit_efficiency(kind: str = "v100", results: Iterable[PublishedResult] = RESULTS) -> float:
    """The one ``compute_efficiency`` of GPU ``kind`` (module docstring): golden-section
    search of the fit rows' mean squared log error over :data:`EFFICIENCY_RANGE`, after a
    coarse grid (the loss need not be unimodal over the whole range). Raises
    ``ValueError`` when ``kind`` has fewer than :data:`MIN_FIT_ROWS` fit rows."""
    rows = [r for r in results if r.fit and GPU_KIND[r.setup.preset] == kind]
    if len(rows) < MIN_FIT_ROWS:
        raise ValueError(
            f"GPU kind {kind!r} has {len(rows)} fit rows; fitting an efficiency needs at "
            f"least {MIN_FIT_ROWS} (mark more absolute-throughput rows fit=True, or keep a "
            "sourced or measured efficiency for this kind)"
        )
    low, high = EFFICIENCY_RANGE
    grid = [low + (high - low) * i / 20 for i in range(21)]
    best = min(grid, key=lambda e: _fit_loss(rows, e))
    a, b = max(low, best - (high - low) / 20), min(high, best + (high - low) / 20)
    golden = (math.sqrt(5) - 1) / 2
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = _fit_loss(rows, c), _fit_loss(rows, d)
    while b - a > 1e-4:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = _fit_loss(rows, c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = _fit_loss(rows, d)
    return round((a + b) / 2, 4)


def reproduce(results: Iterable[PublishedResult] = RESULTS) -> tuple[float, list[RowPrediction]]:
    """The fitted V100 efficiency and every row's prediction at it."""
    results = list(results)
    efficiency = fit_efficiency("v100", results)
    return efficiency, [predict_row(r, efficiency) for r in results]


def _value(metric: str, value: float) -> str:
    return f"{value:.2f}x" if metric == "speedup" else (
        f"{value:.2f} s" if metric == "step_s" else f"{value:.1f}")  # fmt: skip


def markdown_table(rows: Sequence[RowPrediction]) -> list[str]:
    """The papers table of docs/plan-papers.md: published, predicted, error."""
    lines = [
        "| row | claim | published | predicted | error | micro-batch | in the fit |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in rows:
        r = p.result
        published = ("over " if r.at_least else "") + _value(r.metric, r.value)
        error = "holds" if p.within_claim else f"{p.error:+.0%}"
        lines.append(
            f"| {r.key} | {r.paper}: {r.claim} | {published} | "
            f"{_value(r.metric, p.predicted)} | {error} | {p.micro_batch} | "
            f"{'yes' if r.fit else 'no'} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_core.plan.papers",
        description="The ZeRO papers' published results against zero-plan's predictions.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    efficiency, rows = reproduce()
    if args.json:
        print(json.dumps({"v100_compute_efficiency": efficiency,
                          "rows": [r.as_json() for r in rows]}, indent=1))  # fmt: skip
        return 0
    print(f"V100 compute efficiency (fitted): {efficiency:.4f}\n")
    print("\n".join(markdown_table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
