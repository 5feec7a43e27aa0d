#!/usr/bin/env python
"""Flat ZeRO-3, hybrid sharding and ZeRO++ on the emulated two-node cluster (issue 16, item 8).

    python -m tools.cluster.bench                 # what `nox -s cluster` runs (root only):
                                                  # docs/benchmarks/cluster.md and .json
    python -m tools.cluster.bench --rates 100mbit --models small --rounds 2 --steps 2 \\
        --md /tmp/c.md --json /tmp/c.json        # a quick look
    python -m tools.cluster.bench --rerender      # the report again from cluster.json's
                                                  # raw records (no cluster, no root)

Two hosts (tools/cluster/emulated.py: network namespaces, a veth pair rate-limited by tbf
per direction), two ranks on each, launched by torchrun ``--nnodes 2`` on gloo. For each
rate in ``--rates`` (the first is the *main* rate, where the goals are judged) one cluster
is built and one launch of tools/cluster/worker.py trains every model of ``--models``
with every variant of ``--variants``, all stage 3, deterministic communicators (zero-train's
default), from the same seed on the same batches:

    flat        zero-train --stage 3
    hybrid      --shard-group 2                 (MiCS / HSDP: states over one node's ranks)
    hpz         --hpz 2                         (ZeRO++ hpZ: backward gathers inside a node)
    qwz         --quantize-weights              (ZeRO++ qwZ: int8 forward gathers)
    qgz         --quantize-gradients int4       (ZeRO++ qgZ: int4 hierarchical all-to-all)
    zero++      --hpz 2 --quantize-weights --quantize-gradients int4
    fsdp2-hsdp  PyTorch FSDP2, fully_shard on a 2-D DeviceMesh (replicate=2, shard=2)
    deepspeed-hpz  DeepSpeed stage 3, zero_hpz_partition_size 2 (its ZeRO++ hpZ), fp32;
                in the default --variants only where DeepSpeed is importable

Why one launch per rate and not one zero-train run per variant and round: a launch (4 ranks
and 2 launchers importing torch on this 2-core machine) costs tens of seconds, which would
spend the benchmark's time budget on start-up. The worker runs zero-train's own pieces
instead (its option parser, model, batches, learning-rate schedule, engine configuration),
every variant's engine on a communicator of its own, built once and kept for the launch.

Schedule inside a launch, per model: ``--warmup`` untimed steps of every variant, then
``--rounds`` rounds (``--other-rounds`` at the rates after the first) of ``--steps`` timed
steps of every variant, the variant order rotated by one each round (:func:`variant_order`),
so that drift in the machine's load hits every variant alike. Every variant trains
``warmup + rounds x steps`` steps in all, on the same batches, so the final losses
compare. Per step the worker's rank 0 writes one record; tools/cluster/report.py
summarizes the records, judges the goals and renders the report, and its docstring says what
the records, the report's columns and the goals mean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.cluster.report import (
    BASELINE,
    ZEROPP,
    StepRecord,
    check_goals,
    derived_notes,
    link_cost_notes,
    markdown_table,
    parse_records,
    render_report,
    summarize,
    summary_dict,
)
from tools.common.provenance import cpu_model

ROOT = Path(__file__).resolve().parents[2]
# Run by torchrun as a module (--module): its ranks inherit the working folder and
# PYTHONPATH through which this process found the package tools.
WORKER = "tools.cluster.worker"

FSDP2_HSDP = "fsdp2-hsdp"
DEEPSPEED_HPZ = "deepspeed-hpz"
# name -> zero-train flags (on top of --stage 3); None: not ours (FSDP2's HSDP, DeepSpeed's
# hpZ: the worker builds those itself, from the same zero-train options).
VARIANTS: dict[str, list[str] | None] = {
    BASELINE: [],
    "hybrid": ["--shard-group", "2"],
    "hpz": ["--hpz", "2"],
    "qwz": ["--quantize-weights"],
    "qgz": ["--quantize-gradients", "int4"],
    ZEROPP: ["--hpz", "2", "--quantize-weights", "--quantize-gradients", "int4"],
    FSDP2_HSDP: None,
    DEEPSPEED_HPZ: None,
}
# name -> zero-train model flags: the default GPT, and one ~8x its parameters.
MODELS: dict[str, list[str]] = {
    "small": ["--model", "small"],
    "large": ["--model", "small", "--layers", "8", "--width", "256"],
}
DEFAULT_RATES = ("100mbit", "1gbit")
# The link with (nearly) no limit: what each variant's step costs when the link costs
# nothing, so the report can say how much of flat stage 3's step at the slow rates the
# link really takes (measured, not estimated from bytes). Not a goal's rate.
REFERENCE_RATE = "40gbit"
REFERENCE_VARIANTS = (BASELINE, ZEROPP)


# -- the schedule -------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def default_variants(dtype: str = "fp32") -> list[str]:
    """Every variant, less deepspeed-hpz where DeepSpeed is not installed or not fp32."""
    runs_deepspeed = dtype == "fp32" and deepspeed_available()
    return [v for v in VARIANTS if v != DEEPSPEED_HPZ or runs_deepspeed]


def variant_order(variants: Sequence[str], round_index: int) -> list[str]:
    """Round ``round_index``'s order: ``variants`` rotated left by the round's index, so over
    len(variants) rounds every variant runs once in every position."""
    if not variants:
        raise ValueError("variant_order: give at least one variant")
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


# -- running it ---------------------------------------------------------------------------------


def worker_argv(
    args: argparse.Namespace, records: Path, rounds: int, variants: Sequence[str] | None = None
) -> list[str]:
    """The worker's command line (after torchrun's own arguments)."""
    return [
        "-m", WORKER, "--records", str(records), "--models", ",".join(args.models),
        "--variants", ",".join(variants or args.variants), "--rounds", str(rounds),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
        "--batch-size", str(args.batch_size),
    ]  # fmt: skip


def deepspeed_note(variants: Sequence[str] = ()) -> str:
    """Whether DeepSpeed's zero_hpz_partition_size ran beside hpZ (``variants``), or why not."""
    if not deepspeed_available():
        return (
            "DeepSpeed's `zero_hpz_partition_size` was not run beside hpZ: DeepSpeed is not "
            f"installed in this environment ({sys.executable})"
        )
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("deepspeed")
    except PackageNotFoundError:
        release = "?"
    if DEEPSPEED_HPZ not in variants:
        return (
            f"DeepSpeed {release} is importable here, but {DEEPSPEED_HPZ} was left out of "
            "--variants: `zero_hpz_partition_size` was not run"
        )
    return (
        f"{DEEPSPEED_HPZ}: DeepSpeed {release}'s ZeRO stage 3 with `zero_hpz_partition_size` "
        "2 (hpZ groups: the two ranks of a node), fp32, gloo, its CPU accelerator; the same "
        "GPT, initial values, batches, torch AdamW, schedule and clipping as fsdp2-hsdp; "
        "`stage3_max_reuse_distance` and `stage3_prefetch_bucket_size` 0 (otherwise it keeps "
        "forward's gathered parameters until backward on these models, and hpZ's backward "
        "gathers do not happen), the other stage 3 sizes our engine's defaults. Its bytes "
        "are its torch.distributed "
        "calls, counted and split as fsdp2-hsdp's"
    )


def run_rate(
    args: argparse.Namespace, rate: str, folder: Path, variants: Sequence[str] | None = None
) -> tuple[list[StepRecord], list[dict[str, Any]], dict[str, Any]]:
    """One cluster at ``rate``, one launch of the worker (``variants``, default all of
    ``args.variants``): (step records, other records, the link as built and measured)."""
    from tools.cluster import emulated as ec

    records = folder / f"records-{rate}.jsonl"
    with ec.EmulatedCluster(2, rate, "0") as cluster:
        assert cluster.link is not None
        h0, h1 = cluster.hosts
        measured = cluster.measure_throughput(h0, h1, 4 << 20)
        link = {
            "describe": cluster.link.describe(),
            "rate_bits": cluster.link.rate_bits_per_s,
            "measured_mbit": measured.bits_per_s / 1e6,
        }
        print(f"[bench_cluster] {rate}: {link['describe']}, measured "
              f"{link['measured_mbit']:.1f} Mbit/s; launching", flush=True)  # fmt: skip
        started = time.perf_counter()
        link["load_before"] = os.getloadavg()
        sent0, received0 = cluster.link_bytes(h0)
        rounds = args.rounds if rate == args.rates[0] else args.other_rounds
        results = cluster.run_torchrun(
            worker_argv(args, records, rounds, variants), ranks_per_node=2, timeout_s=args.timeout
        )
        link["launch_s"] = round(time.perf_counter() - started, 1)
        link["load_after"] = os.getloadavg()
        sent1, received1 = cluster.link_bytes(h0)
        # Everything that crossed the link in the launch, both ways, headers included: the
        # counted inter-node bytes of every step plus start-up, barriers and gathers.
        link["link_bytes"] = sent1 - sent0 + received1 - received0
    for r in results:
        sys.stdout.write(r.stdout)
    others, steps = parse_records(records.read_text().splitlines())
    link["counted_inter_node_bytes"] = sum(r.inter_node_bytes for r in steps)
    return steps, others, link


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--rates", default=",".join(DEFAULT_RATES),
                        help="tc rates, comma-separated; the first is the main rate")  # fmt: skip
    parser.add_argument("--reference-rate", default=REFERENCE_RATE,
                        help="a link with no real limit, run last ("
                        f"{', '.join(REFERENCE_VARIANTS)} only, --other-rounds) to measure "
                        "what the link costs each at the "
                        "rates; not judged by the goals; 'none' to skip")  # fmt: skip
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--variants", help="the first is the baseline; default: "
                        f"{','.join(VARIANTS)} ({DEEPSPEED_HPZ} with DeepSpeed, fp32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="at the main rate")
    parser.add_argument("--other-rounds", type=int, default=2, help="at the other rates")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--batch-size", type=int, default=16, help="global, zero-train's default")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks" / "cluster.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "benchmarks" / "cluster.json")
    parser.add_argument("--rerender", action="store_true",
                        help="no run: write --md again from --json's raw records")  # fmt: skip
    args = parser.parse_args(argv)
    args.rates = args.rates.split(",")
    args.models = args.models.split(",")
    args.variants = (args.variants or ",".join(default_variants(args.dtype))).split(",")
    unknown = [m for m in args.models if m not in MODELS] + [
        v for v in args.variants if v not in VARIANTS
    ]
    if unknown:
        parser.error(f"unknown {unknown}: models are {list(MODELS)}, variants {list(VARIANTS)}")
    if DEEPSPEED_HPZ in args.variants and not args.rerender:
        if not deepspeed_available():
            parser.error(f"{DEEPSPEED_HPZ} needs DeepSpeed, not installed for {sys.executable}")
        if args.dtype != "fp32":
            parser.error(f"{DEEPSPEED_HPZ} runs fp32 only (was tried in fp32 alone)")
    if args.variants[0] != BASELINE:
        parser.error(f"--variants must start with the baseline {BASELINE!r}")
    if min(args.rounds, args.other_rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--rounds, --other-rounds and --steps must be at least 1, --warmup >= 0")

    if args.rerender:
        payload = json.loads(args.json.read_text())
        write_outputs(args, payload["context"], payload["raw"])
        return 0
    from tools.cluster import emulated as ec

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM (a timeout, nox) becomes KeyboardInterrupt: the cluster's ``with`` block then
    # ends the launch's processes and removes the namespaces.
    signal.signal(signal.SIGTERM, stop)
    started = time.perf_counter()
    made = provenance(args.dtype)
    raw: dict[str, Any] = {}
    links: dict[str, Any] = {}
    failed: list[str] = []
    reference: str | None = None

    def keep(rate: str, launched: tuple[list[StepRecord], list[Any], dict[str, Any]]) -> None:
        steps, others, links[rate] = launched
        raw[rate] = {"records": [s._asdict() for s in steps], "other": others}

    try:
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as folder:
            for rate in args.rates:
                keep(rate, run_rate(args, rate, Path(folder)))
            reference = reference_rate(args)
            if reference is not None:
                # Its own try: a failure here must not lose the rates' measurements.
                variants = [v for v in REFERENCE_VARIANTS if v in args.variants]
                try:
                    keep(reference, run_rate(args, reference, Path(folder), variants))
                except Exception as exc:  # reported in the notes instead
                    failed.append(f"the reference launch at {reference} failed, so the "
                                  f"link's cost was not measured: {exc}")  # fmt: skip
                    print(f"bench_cluster: {failed[-1]}", flush=True)
                    reference = None
    except ec.ClusterUnavailable as exc:
        print(f"bench_cluster: skipped: emulated cluster unavailable: {exc}", flush=True)
        return 0
    wall_s = time.perf_counter() - started
    launches = (o["launch"] for r in raw.values() for o in r["other"] if "launch" in o)
    launch: dict[str, Any] = next(launches, {})
    context = report_context(args, argv, links, launch, made, wall_s)
    context["reference_rate"] = reference
    context["notes"] += failed
    write_outputs(args, context, raw)
    return 0


def reference_rate(args: argparse.Namespace) -> str | None:
    """The reference rate to run, or None ('none', or already among the rates)."""
    if args.reference_rate == "none" or args.reference_rate in args.rates:
        return None
    return str(args.reference_rate)


def write_outputs(args: argparse.Namespace, context: dict[str, Any], raw: dict[str, Any]) -> None:
    """Summarize ``raw`` (rate -> the launch's records), judge the goals at every rate,
    write --md and --json (the context and raw records as given) and print the table."""
    summaries = [
        summary
        for rate, launch in raw.items()
        for summary in summarize(
            [StepRecord(**r) for r in launch["records"]], rate, context["links"][rate]["rate_bits"]
        )
    ]
    reference = context.get("reference_rate")
    judged = [s for s in summaries if s.rate != reference]
    rates = list(dict.fromkeys(s.rate for s in judged))
    verdicts = [v for rate in rates for v in check_goals(judged, rate)]
    notes = derived_notes(judged, context["main_rate"], context.get("dtype", "fp32"))
    if reference is not None:
        notes += link_cost_notes(summaries, reference)
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(
        render_report(summaries, verdicts, {**context, "notes": [*context["notes"], *notes]})
    )
    payload = {
        "context": context,
        "summaries": [summary_dict(s) for s in summaries],
        "goals": [v._asdict() for v in verdicts],
        "notes": notes,
        "raw": raw,
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(markdown_table(summaries))
    for v in verdicts:
        print(v.line())
    print(f"wrote {args.md} and {args.json}; the run took {context['wall_s'] / 60:.1f} min")


def matmul_seconds(dtype: Any, repeats: int = 3) -> float:
    """Median seconds of one (128 x 256) @ (256 x 256) matmul in ``dtype``, one thread."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(128, 256).to(dtype)
    b = torch.randn(256, 256).to(dtype)
    a @ b  # the first call may set up kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def provenance(dtype: str) -> dict[str, Any]:
    """What the numbers were made with, taken before the launches: the commit, the
    packages' sources digest, uncommitted changes, and how much slower bf16 matmuls are
    than fp32's on this CPU (why fp32 is the default)."""
    import torch

    import zero_comm
    import zero_core
    import zero_models
    from tools.common.provenance import git_head, sources_digest

    fp32_s, bf16_s = matmul_seconds(torch.float32), matmul_seconds(torch.bfloat16)
    if dtype == "fp32":
        ratio = bf16_s / fp32_s
        precision = (
            f"fp32 (--dtype); a bf16 matmul took {ratio:.1f}x the fp32 one's time here "
            f"({bf16_s * 1e3:.2f} ms against {fp32_s * 1e3:.2f} ms, 128 x 256 x 256, one thread)"
            + (", so bf16 would make every variant bound by the CPU" if ratio > 2 else "")
        )
    else:
        precision = (
            f"bf16 parameters (fp32 master weights); a bf16 matmul took {bf16_s / fp32_s:.1f}x "
            "the fp32 one's time here"
        )
    return {
        "commit": git_head(),
        "sources": sources_digest(zero_comm, zero_core, zero_models),
        "git_status": _git_status(),
        "torch": torch.__version__,
        "matmul_s": {"fp32": fp32_s, "bf16": bf16_s},
        "precision": precision,
    }


def report_context(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    links: dict[str, Any],
    launch: dict[str, Any],
    made: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """How the run was made, for the report's text and the JSON."""
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    models = "; ".join(
        f"{name} = zero-train {' '.join(MODELS[name])} ({launch.get('params', {}).get(name, '?')} "
        "parameters)"
        for name in args.models
    )
    return {
        "command": f"python -m tools.cluster.bench {flags}".strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **made,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "wall_s": wall_s,
        "main_rate": args.rates[0],
        "dtype": args.dtype,
        "links": links,
        "launch": launch,
        "training": (
            f"{models}; {made['precision']}; global batch {args.batch_size} "
            f"({args.batch_size // 4} sequences per rank), "
            "AdamW and learning-rate schedule, clipping and seed as zero-train's defaults; "
            "every variant stage 3, zero-train's with deterministic communicators. "
            "fsdp2-hsdp: the same "
            "GPT, initial values, batches, AdamW, schedule and clipping, fully_shard per "
            "block and the root on init_device_mesh('cpu', (2, 2), ('replicate', 'shard'))"
        ),
        "schedule": (
            f"{args.warmup} untimed warm-up steps of every variant, then {args.rounds} rounds "
            f"({args.other_rounds} at the other rates) of {args.steps} timed steps of every "
            "variant, the order rotated by one per round"
        ),
        "notes": [deepspeed_note(args.variants), *launch.get("notes", [])],
    }


def _git_status() -> str:
    try:
        done = subprocess.run(["git", "status", "--short"], capture_output=True, text=True,
                              timeout=10, cwd=ROOT, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
