#!/usr/bin/env python
"""Scaling of our stage 3 and FSDP2 over N = 1, 2, 4 ranks: step time and memory per rank.

    python -m tools.peers.scaling                     # docs/benchmarks/scaling.md, scaling.png
    python -m tools.peers.scaling --smoke --out /tmp/s            # seconds: tiny GPT
    python -m tools.peers.scaling --report-only                   # from scaling-json/ again

Two series, on one GPT (``--size``, tools.peers.bench.SIZES):

    strong scaling   global batch fixed (--global-batch G): G / N sequences per rank
    weak scaling     batch per rank fixed (--per-rank-batch b): b N sequences in all

Each (N, sequences per rank) pair is one launch of tools/peers/bench.py (``zero-launch -n N``,
tools.peers.search.peers_launch) that builds and times both variants in one process per rank,
one after the other (tools.peers.bench's block: build, ``--warmup`` untimed + ``--steps`` timed
steps, measure, destroy); a pair that both series need (N with G / N = b) is launched once.
A round launches every pair once; the order of the pairs is reversed every other round, so
drift in the machine's load hits every N alike; ``--rounds`` rounds. Launches run with the
allocator settings of the largest-model search (tools.peers.search.MALLOC_ENV), so memory
figures are not inflated by glibc's dynamic mmap threshold.

Per (series, N, variant), over rounds: step time (bench_peers: the slowest rank's, median
of the block's steps) as median [min - max]; our stage 3's time over FSDP2's of the same
launch (median of rounds); model-state bytes per rank counted from tensors; peak resident
memory increase per rank (bench_peers: over the process's RSS just before the build, the
largest rank) as median [min - max]. Beside them, the paper's prediction per rank:
16Ψ/N bytes of model states (fp32 parameters, gradients and Adam's two moments, all
partitioned, zero_core.model_state_bytes) plus the activation peak of the rank's batch
(zero_core.estimate.activations.activation_bytes). Peak RSS also holds what neither counts:
gathered parameters, communication buffers, allocator slack.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tools.peers.bench import WARMUP_STEPS
from tools.peers.report import paper_model_states_mib
from tools.peers.search import MALLOC_ENV, peers_launch, run_launch
from zero_core.estimate.activations import TransformerShape, activation_bytes

MIB = 2**20
VARIANTS = ("ours-3", "fsdp2")
SERIES = ("strong", "weak")


def launch_pairs(ns: list[int], global_batch: int, per_rank_batch: int) -> list[tuple[int, int]]:
    """The distinct (N, sequences per rank) launches both series need, in N order."""
    for n in ns:
        if global_batch % n:
            raise SystemExit(f"--global-batch {global_batch} is not a multiple of N = {n}")
    pairs = {(n, global_batch // n) for n in ns} | {(n, per_rank_batch) for n in ns}
    return sorted(pairs)


def series_pairs(
    series: str, ns: list[int], global_batch: int, per_rank_batch: int
) -> list[tuple[int, int]]:
    if series == "strong":
        return [(n, global_batch // n) for n in ns]
    return [(n, per_rank_batch) for n in ns]


def json_name(round_: int, n: int, batch: int) -> str:
    return f"round{round_}-n{n}-b{batch}.json"


def run_launches(args: argparse.Namespace, raw: Path) -> None:
    pairs = launch_pairs(args.ns, args.global_batch, args.per_rank_batch)
    size = ["--smoke"] if args.smoke else ["--size", args.size]
    for r in range(args.rounds):
        for n, batch in pairs if r % 2 == 0 else pairs[::-1]:
            options = [
                *size,
                "--batch", str(batch),
                "--rounds", "1",
                "--warmup", str(args.warmup),
                "--steps", str(args.steps),
                "--variants", *args.variants,
                "--json", str(raw / json_name(r, n, batch)),
            ]  # fmt: skip
            run_launch(peers_launch(n, options), f"scaling round {r} N={n} batch {batch}")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(args: argparse.Namespace, raw: Path) -> dict[str, Any]:
    """Every (series, N, variant) row from the launches' JSON files under ``raw``."""
    launches: dict[tuple[int, int], list[dict[str, Any]]] = {}
    first: dict[str, Any] | None = None
    for path in sorted(raw.glob("round*-n*-b*.json")):
        report = json.loads(path.read_text())
        first = first or report
        launches.setdefault((report["world_size"], report["batch_per_rank"]), []).append(report)
    if first is None:
        raise SystemExit(f"no round*-n*-b*.json under {raw}: run the launches first")
    model = first["model"]
    psi = model["parameters"]
    rows = []
    for series in SERIES:
        for n, batch in series_pairs(series, args.ns, args.global_batch, args.per_rank_batch):
            reports = launches.get((n, batch), [])
            shape = TransformerShape(
                model["layers"], model["width"], model["heads"], model["vocab_size"],
                batch * model["context"],
            )  # fmt: skip
            activations = activation_bytes(shape).peak / MIB
            states = paper_model_states_mib("ours-3", psi, n) or 0.0
            for variant in args.variants:
                found = [r for rep in reports for r in rep["results"] if r["variant"] == variant]
                if not found:
                    continue
                ratios = []
                for rep in reports:
                    mine = {r["variant"]: r for r in rep["results"]}
                    if "ours-3" in mine and "fsdp2" in mine:
                        ratios.append(
                            mine["ours-3"]["median_step_s"] / mine["fsdp2"]["median_step_s"]
                        )
                increases = [r["rss_increase_mib"] for r in found if r["rss_increase_mib"]]
                rows.append(
                    {
                        "series": series,
                        "world_size": n,
                        "batch_per_rank": batch,
                        "variant": variant,
                        "rounds": len(found),
                        "step_s": _spread([r["median_step_s"] for r in found]),
                        "ours3_over_fsdp2": statistics.median(ratios) if ratios else None,
                        "model_states_mib": max(r["state_bytes"]["model_states"] for r in found)
                        / MIB,
                        "rss_increase_mib": _spread(increases) if increases else None,
                        "paper_model_states_mib": states,
                        "activation_peak_mib": activations,
                    }
                )
    return {
        "model": model,
        "ns": args.ns,
        "global_batch": args.global_batch,
        "per_rank_batch": args.per_rank_batch,
        "variants": list(args.variants),
        "rounds": args.rounds,
        "warmup": first["warmup"],
        "steps": first["steps"],
        "malloc_env": MALLOC_ENV,
        "date": first["date"],
        "git_head": first["git_head"],
        "uncommitted": first.get("uncommitted", []),
        "machine": first["machine"],
        "versions": first["versions"],
        "launch_command": first["command"],
        "rows": rows,
    }


def _spread_text(spread: dict[str, float] | None, fmt: str) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:{fmt}} [{spread['min']:{fmt}} - {spread['max']:{fmt}}]"


def markdown(summary: dict[str, Any], command: str, wall_s: float | None) -> str:
    model = summary["model"]
    psi = model["parameters"]
    lines = [
        "# Scaling: our stage 3 and FSDP2 on N = " + ", ".join(map(str, summary["ns"])),
        "",
        "Written by `tools/peers/scaling.py` (part of `nox -s bench`); the method is in its "
        "docstring, the raw figures in `scaling-json/`.",
        "",
        f"- date: {summary['date']}; git commit {summary['git_head']}; uncommitted (tools/, "
        "packages/): " + (", ".join(f"`{f}`" for f in summary["uncommitted"]) or "none"),
        f"- command: `{command}`" + (f" ({wall_s / 60:.0f} min)" if wall_s else ""),
        f"- one launch: `{summary['launch_command']}`",
        f"- machine: {summary['machine']['cpu']}, {summary['machine']['cpu_count']} cores, "
        f"{summary['machine']['memory_gib']} GiB; shared with other work. With fewer cores "
        "than ranks, ranks share cores, so time per step cannot fall as 1/N here: the "
        "figures show the overhead of sharding, not the speed-up of more machines",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()),
        f"- GPT {model['layers']} layers x width {model['width']}, {model['heads']} heads, "
        f"context {model['context']}, vocabulary {model['vocab_size']}: Ψ = {psi:,} parameters; "
        f"fp32, AdamW, gloo, one torch thread per rank; {summary['rounds']} rounds of one "
        f"launch per (N, batch), order reversed every other round; each block "
        f"{summary['warmup']} untimed + {summary['steps']} timed steps; allocator "
        + ", ".join(f"{k}={v}" for k, v in summary["malloc_env"].items()),
        f"- strong scaling: {summary['global_batch']} sequences per step in all; weak "
        f"scaling: {summary['per_rank_batch']} per rank",
        "",
        "Step time and peak RSS increase: median [min - max] over rounds. Prediction: 16Ψ/N "
        "model states (zero_core.model_state_bytes, fp32 Adam) + the activation peak of the "
        "rank's batch (zero_core.estimate.activations).",
    ]
    for series in SERIES:
        rows = [r for r in summary["rows"] if r["series"] == series]
        lines += [
            f"\n## {series.capitalize()} scaling\n",
            "| N | sequences/rank | variant | step s | ours-3 / FSDP2 | speed-up over N=1 "
            "| model states MiB (16Ψ/N) | peak RSS increase MiB | 16Ψ/N + activations MiB |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            one = [x for x in rows if x["variant"] == r["variant"] and x["world_size"] == 1]
            speedup = (
                one[0]["step_s"]["median"]
                / r["step_s"]["median"]
                * (r["world_size"] if series == "weak" else 1)
                if one
                else None
            )  # strong: t1 / tN; weak: tokens per second over N=1's, N t1 / tN
            ratio = r["ours3_over_fsdp2"]
            lines.append(
                f"| {r['world_size']} | {r['batch_per_rank']} | {r['variant']} "
                f"| {_spread_text(r['step_s'], '.3f')} "
                f"| {'-' if ratio is None else f'{ratio:.2f}'} "
                f"| {'-' if speedup is None else f'{speedup:.2f}'} "
                f"| {r['model_states_mib']:.0f} ({r['paper_model_states_mib']:.0f}) "
                f"| {_spread_text(r['rss_increase_mib'], '.0f')} "
                f"| {r['paper_model_states_mib'] + r['activation_peak_mib']:.0f} |"
            )
    lines += [
        "",
        "Speed-up: strong scaling t(1) / t(N) (ideal N); weak scaling throughput over N = 1's, "
        "N t(1) / t(N) (ideal N).",
    ]
    return "\n".join(lines) + "\n"


def draw(summary: dict[str, Any], path: Path) -> bool:
    """scaling.png: per series, memory per rank against N beside the prediction, and step
    time against N. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, series in enumerate(SERIES):
        rows = [r for r in summary["rows"] if r["series"] == series]
        memory, time_ax = axes[0][col], axes[1][col]
        for variant in summary["variants"]:
            mine = [r for r in rows if r["variant"] == variant and r["rss_increase_mib"]]
            ns = [r["world_size"] for r in mine]
            med = [r["rss_increase_mib"]["median"] for r in mine]
            err = [
                [m - r["rss_increase_mib"]["min"] for m, r in zip(med, mine, strict=True)],
                [r["rss_increase_mib"]["max"] - m for m, r in zip(med, mine, strict=True)],
            ]
            memory.errorbar(ns, med, yerr=err, marker="o", capsize=3, label=f"{variant} peak RSS")
            states = [r["model_states_mib"] for r in mine]
            memory.plot(ns, states, ":", marker=".", label=f"{variant} model states counted")
            timed = [r for r in rows if r["variant"] == variant]
            t = [r["step_s"]["median"] for r in timed]
            t_err = [
                [m - r["step_s"]["min"] for m, r in zip(t, timed, strict=True)],
                [r["step_s"]["max"] - m for m, r in zip(t, timed, strict=True)],
            ]
            time_ax.errorbar(
                [r["world_size"] for r in timed], t, yerr=t_err, marker="o", capsize=3,
                label=variant,
            )  # fmt: skip
        ref = [r for r in rows if r["variant"] == summary["variants"][0]]
        ns = [r["world_size"] for r in ref]
        memory.plot(ns, [r["paper_model_states_mib"] for r in ref], "k--", label="16Ψ/N")
        memory.plot(
            ns,
            [r["paper_model_states_mib"] + r["activation_peak_mib"] for r in ref],
            "k-",
            label="16Ψ/N + activations",
        )
        batch = (
            f"{summary['global_batch']} sequences in all"
            if series == "strong"
            else f"{summary['per_rank_batch']} per rank"
        )
        memory.set_title(f"{series} scaling ({batch}): memory per rank", fontsize=10)
        memory.set_ylabel("MiB")
        time_ax.set_title(f"{series} scaling: step time", fontsize=10)
        time_ax.set_ylabel("s")
        for ax in (memory, time_ax):
            ax.set_xlabel("N (ranks)")
            ax.set_xticks(summary["ns"])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="tiny GPT (tools.peers.bench's smoke size)")
    p.add_argument("--size", default="20m", help="tools.peers.bench.SIZES")
    p.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--global-batch", type=int, default=4, help="strong scaling: sequences/step")
    p.add_argument("--per-rank-batch", type=int, default=1, help="weak scaling: per rank")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS)  # steady-state steps timed
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--report-only", action="store_true", help="from scaling-json/ again")
    return p


def main() -> None:
    args = parser().parse_args()
    raw = args.out / "scaling-json"
    raw.mkdir(parents=True, exist_ok=True)
    command = " ".join(getattr(sys, "orig_argv", sys.argv))
    run_path = raw / "run.json"
    started = time.time()
    if not args.report_only:
        for old in raw.glob("round*-n*-b*.json"):
            old.unlink()  # a run's rounds only: an earlier run's would mix in
        run_launches(args, raw)
        run_path.write_text(
            json.dumps({"command": command, "wall_s": time.time() - started, "args": vars(args)},
                       default=str)
        )  # fmt: skip
    run = json.loads(run_path.read_text()) if run_path.exists() else {}
    if args.report_only:  # the series of the run that wrote the files, not today's defaults
        for key in ("ns", "global_batch", "per_rank_batch", "variants", "rounds"):
            setattr(args, key, run.get("args", {}).get(key, getattr(args, key)))
    summary = summarize(args, raw)
    summary["written"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    (raw / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, run.get("command", command), run.get("wall_s"))
    drawn = draw(summary, args.out / "scaling.png")
    text += "\n![scaling](scaling.png)\n" if drawn else "\n(No chart: matplotlib is missing.)\n"
    (args.out / "scaling.md").write_text(text)
    print(f"[scaling] wrote {args.out / 'scaling.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
