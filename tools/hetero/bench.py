"""Mixed hardware measured (issue 52): a 2:1 speed mix on two ranks, the default GPT, 12
micro-batches per step, trained with the speed-weighted counts 8,4, the even split 6,6 and
``auto``; step times against the ideal capacity-weighted time.

    python -m tools.hetero.bench                       # padded slots: 0.2 s and 0.4 s
    python -m tools.hetero.bench --mode quota          # cgroup CPU quotas 1 : 0.5 (root)
    python -m tools.hetero.bench --json docs/benchmarks/mixed-hardware.json

Two ways to make rank 1 half as fast without changing a bit (threads per rank are part of
the bits, so not by threads):

- ``pad`` (default, any machine, CI): zero-train's --emulate-micro-batch-seconds S,2S pads
  each micro-batch slot's forward and backward with a sleep to S (rank 0) and 2S (rank 1).
  The ideal micro-step is 12 / (1/S + 1/(2S)) = 8S; counts 8,4 reach it, 6,6 take 12S.
- ``quota`` (root, cgroup v2's cpu.max or v1's cpu.cfs_quota_us): each rank process is
  moved into its own cgroup with a CPU quota, rank 0 QUOTA of a CPU and rank 1 half of it;
  each run's ideal uses its ranks' median slot times (zero-train logs them as slot_s: the
  slots before the last of each micro-step, which waits for the other rank), so it is
  what the slots took under these quotas in that run. Everything a rank
  does runs at its quota, the step's once-per-step work (the row reduction, the optimizer,
  gloo's threads) as well as its slots, so the micro-batch sets how large a share of the
  step the slots are: 8 sequences by default (1 with ``pad``, whose padding is the slot).

``auto``'s once-per-step cost comes from the planner's terms on this machine's calibration
(the stored one, else one measured first, about 30 s). Each configuration runs --steps
steps; the first --skip are dropped (start-up, the quota's move); the table gives the
median step time (zero-train's step_s: the slowest rank's) and its spread (min-max), the
ratio to the ideal, and the speed-up over the even split.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.common.provenance import git_head

from .cpu_quota import CpuQuota, quota_problem

COUNTS = ("8,4", "6,6", "auto")
TOTAL = 12


def zero_train(args: argparse.Namespace, counts: str, out: Path) -> list[str]:
    """The zero-train command of one configuration."""
    command = [
        sys.executable, "-m", "zero_models.train", "--nproc", "2", "--steps", str(args.steps),
        "--batch-size", str(TOTAL * args.micro_batch), "--micro-batches-per-rank", counts,
        "--threads", "1", "--sample-tokens", "0", "--no-final-save", "--warmup", "1",
        "--out", str(out), "--overwrite", "--stage", str(args.stage),
    ]  # fmt: skip
    if counts == "auto":
        command += ["--virtual-ranks", str(TOTAL)]
    if args.mode == "pad":
        command += ["--emulate-micro-batch-seconds", f"{args.seconds},{2 * args.seconds}"]
    return command


def calibration_env(folder: Path) -> dict[str, str]:
    """The environment that gives ``auto`` this machine's calibration (its once-per-step
    cost then comes from the planner's terms, zero_core.hetero.planned): the stored one,
    else one measured now at the default GPT's width into ``folder`` (about 30 s)."""
    from zero_core.plan.calibrate import ENV_VAR, calibrate, load_calibration

    if load_calibration() is not None:
        return {}
    path = folder / "calibration.json"
    print("bench: no stored calibration (zero-plan --calibrate); measuring one", flush=True)
    calibrate(path, widths=(128,))
    return {ENV_VAR: str(path)}


def run_one(
    args: argparse.Namespace, counts: str, folder: Path, extra_env: dict[str, str]
) -> dict[str, Any]:
    """Train one configuration; its step times and run record."""
    out = folder / counts.replace(",", "-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    started = time.perf_counter()
    process = subprocess.Popen(zero_train(args, counts, out), env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    quota = None
    if args.mode == "quota":
        quota = CpuQuota(process.pid, (args.quota, args.quota / 2))
    try:
        output, _ = process.communicate(timeout=args.timeout)
    finally:
        if quota is not None:
            quota.remove()
    if quota is not None and len(quota.moved) < 2:
        raise SystemExit(f"bench: only ranks {sorted(quota.moved)} were put under their quota")
    if process.returncode != 0:
        raise SystemExit(f"bench: zero-train {counts} failed ({process.returncode}):\n{output}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = next(r["run"] for r in records if "run" in r)
    steps = [r["step_s"] for r in records if "run" not in r][args.skip :]
    # Each rank's median slot of each step (zero-train's slot_s): the ideal's t_i.
    slots = [r["slot_s"] for r in records if "run" not in r][args.skip :]
    return {
        "counts": counts,
        "chosen": run.get("micro_batches_per_rank"),
        "step_s": steps,
        "median_s": statistics.median(steps),
        "min_s": min(steps),
        "max_s": max(steps),
        "slot_s": [list(rank) for rank in zip(*slots, strict=True)],  # [rank][step]
        "predicted_s": run.get("auto", {}).get("predicted_step_s"),
        "profiles": run.get("auto", {}).get("profiles"),
        "wall_s": round(time.perf_counter() - started, 1),
        "auto_line": next((x for x in output.splitlines() if "zero-train: auto:" in x), None),
    }


def ideal_seconds(args: argparse.Namespace, row: dict[str, Any]) -> float:
    """The capacity-weighted micro-step of one configuration's run, TOTAL / sum_i 1/t_i:
    with padding t = (S, 2S); with quotas, t_i is rank i's median slot over the run's
    steps (zero-train's slot_s), so the ideal is that of the ranks as fast as they were
    in that run (the machine's speed drifts by several percent between runs)."""
    if args.mode == "pad":
        times = [args.seconds, 2 * args.seconds]
    else:
        times = [statistics.median(rank) for rank in row["slot_s"]]
    return float(TOTAL / sum(1 / t for t in times))


def table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    even = next(r for r in rows if r["counts"] == "6,6")["median_s"]
    lines = [
        "| counts | median step (s) | spread min-max (s) | ideal (s) | / ideal | "
        "even split / this | predicted (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["counts"] if r["counts"] != "auto" else f"auto ({','.join(map(str, r['chosen']))})"
        ideal = ideal_seconds(args, r)
        predicted = "" if r["predicted_s"] is None else (
            f"{r['predicted_s']:.3f} ({100 * (r['median_s'] / r['predicted_s'] - 1):+.1f}%)"
        )  # fmt: skip
        lines.append(
            f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
            f"{ideal:.3f} | {r['median_s'] / ideal:.3f}x | {even / r['median_s']:.3f}x | "
            f"{predicted} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hetero.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--mode", choices=("pad", "quota"), default="pad")
    p.add_argument("--seconds", type=float, default=0.2, help="pad: rank 0's seconds per slot")
    p.add_argument("--quota", type=float, default=1.0, help="quota: rank 0's CPUs (rank 1: half)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per slot (default: 1 with pad, 8 with quota)")  # fmt: skip
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage (the docs' tables: 2)")
    p.add_argument("--steps", type=int, default=None, help="default: 8 with pad, 12 with quota")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    if args.micro_batch is None:
        args.micro_batch = 8 if args.mode == "quota" else 1
    if args.steps is None:  # quota runs are noisier: more steps for their medians
        args.steps = 12 if args.mode == "quota" else 8
    if args.mode == "quota":
        problem = quota_problem()
        if problem:
            print(f"bench: --mode quota: {problem}; use --mode pad", file=sys.stderr)
            return 2
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hetero-bench-") as folder:
        extra_env = calibration_env(Path(folder))
        for counts in COUNTS:
            rows.append(run_one(args, counts, Path(folder), extra_env))
            print(f"bench: {counts}: median {rows[-1]['median_s']:.3f} s", flush=True)
    for row in rows:
        row["ideal_s"] = ideal_seconds(args, row)
    print("\n".join(table(args, rows)))
    if args.json is not None:
        report = {"mode": args.mode, "seconds": args.seconds, "quota": args.quota,
                  "micro_batch": args.micro_batch, "stage": args.stage, "steps": args.steps,
                  "skip": args.skip, "commit": git_head(), "cpus": os.cpu_count(),
                  "load_before": load_before, "load_after": os.getloadavg(),
                  "rows": rows}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
