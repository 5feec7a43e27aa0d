"""Where ZeRO++ pays: the per-rank compute rate and link bandwidth at which it is a given
factor faster than flat stage 3 (issue 51, point 5; the question issue 16 left open).

    python -m zero_core.plan.zeropp_gain --calibration docs/benchmarks/plan-calibration.json
    python -m zero_core.plan.zeropp_gain --target 1.5 --json   # the stored calibration

The emulated cluster is zero_core.plan.validation's (:func:`emulated_fit`): its
``fitted_cluster`` with the one compute factor ``fitted_factor`` finds on the measured
table (--bench, docs/benchmarks/cluster.json), so docs/plan.md's cluster table and this
answer (docs/plan-papers.md) come from one cluster.

ZeRO++ (hpZ over a node, qwZ int8 forward gathers, qgZ int4 gradients) cuts a step's
inter-node bytes to about a sixth of flat stage 3's in float32 (docs/benchmarks/cluster.md:
0.176), and pays for it in coding time and in intra-node hops. Its speed-up

    gain(F, B) = step_flat(F, B) / step_zero++(F, B)

(:func:`gain`, both steps from :func:`zero_core.plan.step_time.predict`) grows as the link
bandwidth B per node falls and as the achieved compute rate F per rank rises, from about
1 (compute-bound: the link is idle anyway, and coding costs) toward the byte ratio (link-
bound). For each F, :func:`bandwidth_for_gain` finds by bisection the largest B at which
the gain still reaches the target: below that bandwidth ZeRO++ is at least that much
faster; :func:`flops_for_gain` is the other cut, the smallest F at which a given link
yields the target. :func:`gain_table` sweeps F.

The answer scales: every term but the latencies and per-operator overheads is bytes over a
rate or FLOPs over a rate, so multiplying F and B (and the memory and codec rates) by the
same factor leaves the gain unchanged; what matters is flat's link time relative to its
compute time, which the table's last column gives at the threshold.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from . import validation
from .calibrate import load_calibration
from .cluster import Cluster
from .configuration import PlanConfig
from .paper_presets import V100_EFFICIENCY
from .paper_results import ZPP_18B, PaperSetup
from .papers import setup_cluster, setup_config, setup_workload
from .step_time import predict
from .workload import Workload

FLAT = PlanConfig(stage=3)
BANDWIDTH_RANGE = (1e3, 1e13)  # bytes/s per node searched by bandwidth_for_gain
FLOPS_RANGE = (1e6, 1e18)  # FLOP/s per rank searched by flops_for_gain


def zeropp_config(cluster: Cluster, flat: PlanConfig = FLAT) -> PlanConfig:
    """``flat`` with ZeRO++ on, as the cluster benchmark runs it (tools/cluster/bench.py:
    --hpz over a node, --quantize-weights, --quantize-gradients int4)."""
    return flat.with_(
        hpz=cluster.devices_per_node, quantize_weights=True, quantize_gradients="int4"
    )


def gain(workload: Workload, cluster: Cluster, flat: PlanConfig = FLAT) -> float:
    """Flat stage 3's predicted step over ZeRO++'s on ``cluster``."""
    zpp = zeropp_config(cluster, flat)
    return predict(workload, cluster, flat).step_s / predict(workload, cluster, zpp).step_s


def at_rates(
    cluster: Cluster, flops: float | None = None, bandwidth: float | None = None
) -> Cluster:
    """``cluster`` with achieved compute rate ``flops`` per rank (through
    compute_efficiency) and ``bandwidth`` bytes/s per node between nodes."""
    changes: dict[str, Any] = {}
    if flops is not None:
        changes["compute_efficiency"] = flops / cluster.peak_flops
        if flops > cluster.peak_flops:
            changes["peak_flops"] = flops
            changes["compute_efficiency"] = 1.0
    if bandwidth is not None:
        changes["inter_bandwidth"] = bandwidth
    return cluster.with_(**changes)


def bandwidth_for_gain(
    workload: Workload, cluster: Cluster, target: float = 1.5, flat: PlanConfig = FLAT
) -> float | None:
    """The largest inter-node bandwidth (bytes/s per node) at which ZeRO++ is at least
    ``target`` times faster than flat stage 3 on ``cluster`` (its compute rate as given);
    None if it is not even at the lowest bandwidth searched. The gain falls as bandwidth
    rises, so bisection on log(bandwidth) finds it."""
    low, high = BANDWIDTH_RANGE
    if gain(workload, at_rates(cluster, bandwidth=low), flat) < target:
        return None
    if gain(workload, at_rates(cluster, bandwidth=high), flat) >= target:
        return high
    return _boundary(
        lambda bandwidth: gain(workload, at_rates(cluster, bandwidth=bandwidth), flat) >= target,
        inside=low,
        outside=high,
    )


def flops_for_gain(
    workload: Workload, cluster: Cluster, target: float = 1.5, flat: PlanConfig = FLAT
) -> float | None:
    """The smallest achieved compute rate per rank (FLOP/s) at which ZeRO++ is at least
    ``target`` times faster than flat stage 3 on ``cluster`` (its link as given); None if
    not even at the fastest rate searched. The gain rises with the compute rate (the
    compute shrinks, the link time stays), so bisection on log(rate) finds it."""
    low, high = FLOPS_RANGE
    if gain(workload, at_rates(cluster, flops=high), flat) < target:
        return None
    if gain(workload, at_rates(cluster, flops=low), flat) >= target:
        return low
    return _boundary(
        lambda flops: gain(workload, at_rates(cluster, flops=flops), flat) >= target,
        inside=high,
        outside=low,
    )


def _boundary(holds: Callable[[float], bool], inside: float, outside: float) -> float:
    """Where ``holds`` stops holding, from its side, within 0.1%: ``holds(inside)`` is
    True and ``holds(outside)`` False (either may be the larger), and it changes once
    between them; bisection on the log scale."""
    for _ in range(80):
        mid = math.sqrt(inside * outside)
        if holds(mid):
            inside = mid
        else:
            outside = mid
        if max(inside, outside) / min(inside, outside) < 1.001:
            break
    return inside


class GainRow(NamedTuple):
    """One compute rate: the bandwidth threshold and flat's link / compute time there."""

    flops: float  # achieved FLOP/s per rank
    bandwidth: float | None  # bytes/s per node; None: never reaches the target
    link_over_compute: float | None  # flat stage 3's link time / compute time there


def gain_table(
    workload: Workload, cluster: Cluster, flops: Sequence[float], target: float = 1.5,
    flat: PlanConfig = FLAT,
) -> list[GainRow]:  # fmt: skip
    """:func:`bandwidth_for_gain` at each achieved compute rate in ``flops``."""
    rows = []
    for f in flops:
        at = at_rates(cluster, flops=f)
        b = bandwidth_for_gain(workload, at, target, flat)
        ratio = None
        if b is not None:
            t = predict(workload, at_rates(at, bandwidth=b), flat).terms
            link = sum(v for k, v in t.items() if k.startswith("link_"))
            ratio = link / (t["compute_forward"] + t["compute_backward"])
        rows.append(GainRow(f, b, ratio))
    return rows


def cluster_workloads() -> dict[str, Workload]:
    """The cluster benchmark's two models (tools/cluster/bench.py), as
    zero_core.plan.validation builds them: zero-train's small GPT and --layers 8 --width
    256, float32, global batch 16."""
    return {name: validation.workload(name) for name in validation.MODELS}


class Emulated(NamedTuple):
    """The emulated cluster as zero_core.plan.validation predicts it: this machine's
    ``calibration`` and the one compute ``factor`` fitted on ``bench`` (a cluster.json)."""

    bench: dict[str, Any]
    calibration: dict[str, Any]
    factor: float

    def cluster(self, rate: str, workload: Workload) -> Cluster:
        """validation.fitted_cluster at link ``rate``, the model's width."""
        return validation.fitted_cluster(self.calibration, rate, workload.width, self.factor)


def emulated_fit(bench: dict[str, Any], calibration: dict[str, Any]) -> Emulated:
    """:class:`Emulated` with validation's fitted factor for ``bench`` and ``calibration``."""
    factor = validation.fitted_factor(validation.measured_rows(bench), calibration)
    return Emulated(bench, calibration, factor)


class Check(NamedTuple):
    """One measured cluster row beside the prediction."""

    model: str
    rate: str
    measured_flat_s: float
    measured_zeropp_s: float
    measured_gain: float
    predicted_flat_s: float
    predicted_zeropp_s: float
    predicted_gain: float


def measured_gains(bench: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(model, rate) -> flat's and ZeRO++'s median step s and ZeRO++'s median speed-up
    (over rounds, the same round's ratio), from validation.measured_rows of ``bench``."""
    rows = {(r["model"], r["rate"], r["variant"]): r for r in validation.measured_rows(bench)}
    return {
        (model, rate): (flat["step_s"], rows[model, rate, "zero++"]["step_s"],
                        rows[model, rate, "zero++"]["speedup"])
        for (model, rate, variant), flat in rows.items()
        if variant == "flat" and (model, rate, "zero++") in rows
    }  # fmt: skip


def check_emulated(fit: Emulated) -> list[Check]:
    """Every measured flat / ZeRO++ pair of ``fit.bench`` with the model's flat and ZeRO++
    steps on the fitted emulated cluster at that rate."""
    out = []
    models = cluster_workloads()
    for (name, rate), (flat_s, zpp_s, measured) in measured_gains(fit.bench).items():
        workload = models[name]
        cluster = fit.cluster(rate, workload)
        flat = predict(workload, cluster, FLAT).step_s
        zpp = predict(workload, cluster, zeropp_config(cluster)).step_s
        out.append(Check(name, rate, flat_s, zpp_s, measured, flat, zpp, flat / zpp))
    return out


def paper_scale(target: float = 1.5) -> tuple[Cluster, Workload, list[GainRow]]:
    """The same question at the ZeRO++ paper's scale: its 18B model at 1K tokens per GPU on
    24 DGX-2s (the V100 preset, its fitted efficiency), fp16, as zero_core.plan.papers
    runs that row."""
    setup = PaperSetup("zeropp-dgx2-100g", gpus=384, stage=3, micro_batch=2)
    cluster = setup_cluster(setup, V100_EFFICIENCY)
    flat = setup_config("ZeRO++", setup, cluster)
    workload = setup_workload(ZPP_18B, setup, 2)
    flops = [cluster.achieved_flops * 10 ** (k / 2) for k in range(-2, 5)]
    return cluster, workload, gain_table(workload, cluster, flops, target, flat)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_core.plan.zeropp_gain",
        description="At which per-rank compute rate and link bandwidth is ZeRO++ TARGET "
        "times faster than flat stage 3? (the emulated cluster's models)",
    )
    parser.add_argument("--target", type=float, default=1.5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--bench",
        type=Path,
        default=Path("docs/benchmarks/cluster.json"),
        help="the emulated cluster's measured table (nox -s cluster)",
    )
    parser.add_argument("--calibration", type=Path,
                        help="this machine's calibration (default: the stored one; the docs "
                        "use docs/benchmarks/plan-calibration.json)")  # fmt: skip
    args = parser.parse_args(argv)
    calibration = load_calibration(args.calibration)
    if calibration is None:
        parser.error("no calibration: run zero-plan --calibrate first, or pass --calibration")
    fit = emulated_fit(json.loads(args.bench.read_text()), calibration)
    out: dict[str, Any] = {"target": args.target, "factor": fit.factor, "models": {},
                           "checks": []}  # fmt: skip
    for name, workload in cluster_workloads().items():
        cluster = fit.cluster("1gbit", workload)
        flops = [cluster.achieved_flops * 10 ** (k / 2) for k in range(-2, 9)]
        rows = gain_table(workload, cluster, flops, args.target)
        out["models"][name] = [r._asdict() for r in rows]
    out["checks"] = [c._asdict() for c in check_emulated(fit)]
    out["flops_needed"] = {
        f"{name} at {rate}": flops_for_gain(w, fit.cluster(rate, w), args.target)
        for name, w in cluster_workloads().items()
        for rate in ("100mbit", "1gbit", "40gbit")
    }
    _, _, paper_rows = paper_scale(args.target)
    out["models"]["ZeRO++ 18B on 24 DGX-2 (1K tokens/GPU)"] = [r._asdict() for r in paper_rows]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"The emulated cluster ({args.bench}), measured and predicted (calibration "
        f"{calibration.get('measured_at')}, fitted compute factor {fit.factor:.3f}):"
    )
    print("  model | rate | flat s: measured, predicted | ZeRO++ s | gain: measured, predicted")
    for c in out["checks"]:
        print(f"  {c['model']} | {c['rate']} | {c['measured_flat_s']:.3f}, "
              f"{c['predicted_flat_s']:.3f} | {c['measured_zeropp_s']:.3f}, "
              f"{c['predicted_zeropp_s']:.3f} | {c['measured_gain']:.2f}x, "
              f"{c['predicted_gain']:.2f}x")  # fmt: skip
    print(f"Achieved GFLOP/s per rank for ZeRO++ >= {args.target}x on the emulated links:")
    for key, f in out["flops_needed"].items():
        print(f"  {key}: {'never' if f is None else f'{f / 1e9:.4g}'}")
    for name, rows in out["models"].items():
        print(f"{name}: ZeRO++ >= {args.target}x flat stage 3 below this inter-node bandwidth")
        print("  achieved GFLOP/s per rank | Gbit/s per node | flat's link / compute there")
        for r in rows:
            bw = "never" if r["bandwidth"] is None else f"{r['bandwidth'] * 8 / 1e9:.4g}"
            ratio = "-" if r["link_over_compute"] is None else f"{r['link_over_compute']:.2f}"
            print(f"  {r['flops'] / 1e9:>24.4g} | {bw:>15} | {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
