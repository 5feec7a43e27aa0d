"""The emulated cluster's measured step times (nox -s cluster: docs/benchmarks/cluster.json)
against zero-plan's predictions, as a markdown table for docs/plan.md:

    python -m zero_core.plan.validation docs/benchmarks/cluster.json \
        --calibration docs/benchmarks/plan-calibration.json

Each measured variant is stage 3 on 2 nodes x 2 ranks of this machine (fp32, global batch
16; small = zero-train's default GPT, large = --layers 8 --width 256), at each link rate
(the emulated-cluster-RATE presets). Two predictions per row:

    calibrated   the emulated-cluster preset from this machine's calibration (taken now,
                 under today's load, not the benchmark's)
    fitted       the same with the rank's compute rates scaled by one fitted factor: the
                 one that makes the predicted flat stage 3 at 40gbit (the rate where the
                 link does not limit) equal the measured one, geometric mean over the two
                 models; every other row is predicted with it (:func:`fitted_cluster`)

docs/benchmarks/plan-calibration.json is the calibration docs/plan.md's table and
docs/plan-papers.md's point-5 answer (zero_core.plan.zeropp_gain, which builds its clusters
with :func:`fitted_cluster` and :func:`fitted_factor`) are computed from.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from .calibrate import load_calibration
from .cluster import Cluster
from .configuration import PlanConfig
from .presets import emulated_cluster
from .step_time import predict
from .workload import Workload, workload_from_gpt

VARIANTS = {
    "flat": PlanConfig(stage=3),
    "hybrid": PlanConfig(stage=3, shard_group=2),
    "hpz": PlanConfig(stage=3, hpz=2),
    "qwz": PlanConfig(stage=3, quantize_weights=True),
    "qgz": PlanConfig(stage=3, quantize_gradients="int4"),
    "zero++": PlanConfig(stage=3, hpz=2, quantize_weights=True, quantize_gradients="int4"),
}
MODELS: dict[str, dict[str, int | None]] = {
    "small": {},
    "large": {"layers": 8, "width": 256},
}
REFERENCE_RATE = "40gbit"


def workload(model: str, batch_size: int = 16) -> Workload:
    shape = MODELS[model]
    return workload_from_gpt(
        "small", batch_size=batch_size, layers=shape.get("layers"), width=shape.get("width")
    )


def measured_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """(model, rate, variant, median step s, median speed-up over flat) of our variants in
    a cluster.json; the speed-up is the median over rounds of the same round's ratio."""
    return [
        {"model": s["model"], "rate": s["rate"], "variant": s["variant"],
         "step_s": s["step_s"]["median"], "speedup": s["speedup"]["median"]}
        for s in bench["summaries"] if s["variant"] in VARIANTS and s["model"] in MODELS
    ]  # fmt: skip


def fitted_cluster(calibration: dict[str, Any], rate: str, width: int, factor: float) -> Cluster:
    """The emulated cluster at link ``rate`` (presets.emulated_cluster, the model's
    ``width``) with every rate a rank computes at scaled by ``factor``: matmuls
    (compute_efficiency), elementwise and activation work, the optimizer and the codecs,
    and the per-operator, per-launch, per-unit and per-step overheads by 1 / factor. The
    link is the measured one, not scaled: the factor stands for the load the benchmark ran
    under, which slowed the cores, not the shaped link."""
    cluster = emulated_cluster(calibration, rate, width)
    return cluster.with_(
        compute_efficiency=cluster.compute_efficiency * factor,
        op_overhead=cluster.op_overhead / factor,
        launch_overhead=cluster.launch_overhead / factor,
        unit_overhead=cluster.unit_overhead / factor,
        step_overhead=cluster.step_overhead / factor,
        memory_bandwidth=cluster.memory_bandwidth * factor,
        activation_bandwidth=cluster.activation_bandwidth * factor,
        optimizer_rate=cluster.optimizer_rate * factor,
        codec_rate=cluster.codec_rate * factor,
    )


def fitted_factor(rows: list[dict[str, Any]], calibration: dict[str, Any]) -> float:
    """The one compute factor (module docstring), from :func:`measured_rows`."""
    logs = []
    for row in rows:
        if row["variant"] == "flat" and row["rate"] == REFERENCE_RATE:
            w = workload(row["model"])
            cluster = emulated_cluster(calibration, REFERENCE_RATE, w.width)
            logs.append(math.log(predict(w, cluster, VARIANTS["flat"]).step_s / row["step_s"]))
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


def compare(bench: dict[str, Any], calibration: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row with its two predictions (module docstring)."""
    rows = measured_rows(bench)
    factor = fitted_factor(rows, calibration)
    out = []
    for row in rows:
        w = workload(row["model"])
        cluster: Cluster = emulated_cluster(calibration, row["rate"], w.width)
        calibrated = predict(w, cluster, VARIANTS[row["variant"]])
        fitted = predict(
            w, fitted_cluster(calibration, row["rate"], w.width, factor), VARIANTS[row["variant"]]
        )
        out.append({**row, "calibrated": calibrated.step_s, "fitted": fitted.step_s,
                    "link_s": sum(v for k, v in fitted.terms.items() if k.startswith("link_")),
                    "factor": factor})  # fmt: skip
    return out


def markdown(rows: list[dict[str, Any]], calibration: dict[str, Any]) -> str:
    lines = [
        f"Calibration: {calibration.get('measured_at')}, load average "
        f"{calibration.get('load_average')}; fitted compute factor "
        f"{rows[0]['factor'] if rows else 1:.3f} (on flat at {REFERENCE_RATE})",
        "",
        "| model | rate | variant | measured s | predicted s (calibrated) | error | "
        "predicted s (fitted) | error | of which links s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["step_s"]
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['variant']} | {m:.3f} | {r['calibrated']:.3f} | "
            f"{r['calibrated'] / m - 1:+.0%} | {r['fitted']:.3f} | {r['fitted'] / m - 1:+.0%} | "
            f"{r['link_s']:.3f} |"
        )
    errors = [abs(r["fitted"] / r["step_s"] - 1) for r in rows]
    if errors:
        lines += ["", f"fitted: median |error| {sorted(errors)[len(errors) // 2]:.0%}, "
                  f"largest {max(errors):.0%}, within 30%: {sum(e <= 0.3 for e in errors)} of "
                  f"{len(errors)}"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bench", type=Path, help="docs/benchmarks/cluster.json")
    parser.add_argument("--calibration", type=Path, help="default: the stored one")
    args = parser.parse_args()
    calibration = load_calibration(args.calibration)
    if calibration is None:
        parser.error("no calibration: run zero-plan --calibrate first")
    bench = json.loads(args.bench.read_text())
    print(markdown(compare(bench, calibration), calibration))


if __name__ == "__main__":
    main()
