"""The offload headline: under one per-rank memory cap, the largest GPT that stage 3 trains
with its model states on disk (ZeRO-Infinity) against the largest that stage 3 trains
without offload, with tokens/s of both; written to docs/benchmarks/offload.md.

The disk variant runs twice: with the gradient tier (``ours-3-disk``: gradients follow the
optimizer to disk, the default) and without it (``ours-3-disk-grads-on-device``:
``offload_gradients=False``, zero-train's ``--no-offload-gradients``). For each, the bytes
its last probe step read from and wrote to swap files (the engine's counters) stand beside
zero-estimate's host <-> disk bytes for the same run (``zero-estimate --json``'s links).

    python -m tools.offload.bench --cap-mib 1024 --nproc 2 --minutes 50

Each probe is `zero-launch -n N python -m tools.peers.bench --probe VARIANT ...`: after
``zero_comm.init`` each rank caps its address space (RLIMIT_AS) at its size then plus
``--cap-mib``, builds the GPT (width ``--width``, growing layers; on the meta device,
values streamed), and trains ``--probe-steps`` steps of one sequence per rank; an
allocation past the cap fails inside that rank. The search per variant grows the layer
count x1.5 until a probe fails, then bisects. Model states are the paper's 16 bytes per
parameter (float32 parameters and gradients, Adam's two moments), for the whole model.
The swap files go to ``--offload-dir`` (default: a folder under the temporary folder).
Figures of the swap pipeline and the CPU optimizer step (tools/offload/swap.py,
tools/offload/cpu_optimizer.py) are added from their JSON files when present.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.peers.search import search_layers
from zero_models.gpt import GPTConfig

BENCH = "tools.peers.bench"  # run as a module: its launches inherit how this one found it
LAUNCHER = (sys.executable, "-m", "zero_comm.launch")
VARIANTS = ("ours-3", "ours-3-disk", "ours-3-disk-grads-on-device", "deepspeed-3-cpu")
# The probe each variant runs (tools.peers.trainers) and what its environment adds.
PROBES = {"ours-3-disk-grads-on-device": ("ours-3-disk", {"ZERO_BENCH_OFFLOAD_GRADIENTS": "0"})}
DISK_VARIANTS = ("ours-3-disk", "ours-3-disk-grads-on-device")
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
MODEL_STATE_BYTES = 16  # float32 parameter + gradient + Adam's two moments
MIB = 2**20
# docs/benchmarks/offload.md from this line on is not generated: a run keeps it.
KEPT = "<!-- not generated: tools.offload.bench keeps what follows -->"


def config(args: argparse.Namespace, layers: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=256, context=args.context, layers=layers, heads=args.heads, width=args.width
    )


def probe(args: argparse.Namespace, variant: str, layers: int) -> dict[str, Any]:
    """One launch: {"ok", "how", "parameters", "seconds", ranks' records}."""
    psi = config(args, layers).num_params
    record: dict[str, Any] = {"variant": variant, "layers": layers, "parameters": psi}
    # A folder of the probe's own under --offload-dir, removed with it: a probe ends with
    # os._exit (tools.peers.bench), so its engines leave their swap files behind (GBs each).
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(prefix="probe-", dir=args.offload_dir) as swap,
    ):
        out = Path(tmp) / "probe.json"
        probe_variant, probe_env = PROBES.get(variant, (variant, {}))
        command = [
            *LAUNCHER, "-n", str(args.nproc), sys.executable, "-m", BENCH, "--probe", probe_variant,
            "--width", str(args.width), "--heads", str(args.heads), "--context",
            str(args.context), "--layers", str(layers), "--batch", "1", "--budget-mib",
            str(args.cap_mib), "--probe-steps", str(args.probe_steps), "--json", str(out),
        ]  # fmt: skip
        env = {
            **os.environ,
            **MALLOC_ENV,
            "OMP_NUM_THREADS": str(args.threads),
            "ZERO_BENCH_OFFLOAD_DIR": swap,
            "ZERO_BENCH_BUCKET_NUMEL": str(args.bucket_numel),
            "ZERO_BENCH_SUB_GROUP_NUMEL": str(args.sub_group_numel),
            "ZERO_BENCH_PREFETCH_NUMEL": str(args.prefetch_numel),
            "DS_ACCELERATOR": "cpu",
            **probe_env,
        }
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=args.probe_timeout
            )
        except subprocess.TimeoutExpired:
            return {**record, "ok": False, "how": "timeout", "seconds": args.probe_timeout}
        seconds = time.perf_counter() - started
        if done.returncode == 0 and out.exists():
            return {**record, **json.loads(out.read_text()), "how": "ran", "seconds": seconds}
        oom = "PROBE-OOM" in done.stderr or "Cannot allocate memory" in done.stderr
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])[-400:]
        return {**record, "ok": False, "how": ("oom: " if oom else "error: ") + tail,
                "seconds": seconds}  # fmt: skip


def largest(args: argparse.Namespace, variant: str, deadline: float) -> dict[str, Any]:
    """The most layers ``variant`` trains under the cap (grow x1.5, then bisect)."""
    per_layer = config(args, 2).num_params - config(args, 1).num_params
    # A first guess from the resident model states: 16Ψ/N without offload; with every
    # state on disk, the float32 gradient shard (4Ψ/N) and working buffers; with the
    # gradients on disk too, working buffers alone (1 for a guess).
    resident = {"ours-3-disk": 1, "ours-3-disk-grads-on-device": 4}.get(variant, MODEL_STATE_BYTES)
    guess = max(1, int(0.5 * args.cap_mib * MIB * args.nproc / (resident * per_layer)))
    given = dict(item.split("=") for item in args.first_layers)
    guess = int(given.get(variant, guess))
    lo, hi, probes = search_layers(
        lambda layers: probe(args, variant, layers),
        guess,
        max_probes=args.max_probes,
        deadline=deadline,
        label="offload",
    )
    best = next((p for p in probes if p["ok"] and p["layers"] == lo), None)
    return {"variant": variant, "layers": lo, "first_failing_layers": hi or None,
            "best": best, "probes": probes}  # fmt: skip


def tokens_per_second(args: argparse.Namespace, best: dict[str, Any] | None) -> float | None:
    """Tokens of all ranks per second, from the slowest rank's median step."""
    if best is None:
        return None
    steps = [statistics.median(r["step_seconds"]) for r in best["ranks"] if r["step_seconds"]]
    return args.nproc * args.context / max(steps) if steps else None


def row(args: argparse.Namespace, result: dict[str, Any]) -> str:
    best = result["best"]
    if best is None:
        return f"| {result['variant']} | - | - | - | - | - | - |"
    psi = best["parameters"]
    states = MODEL_STATE_BYTES * psi
    rank0 = best["ranks"][0]
    tps = tokens_per_second(args, best)
    return (
        f"| {result['variant']} | {result['layers']} ({psi / 1e6:.0f}M) "
        f"| {states / MIB:,.0f} MiB = {states / (args.cap_mib * MIB):.1f}x the cap "
        f"| {rank0['rss_increase_mib']:.0f} / {rank0['vm_increase_mib']:.0f} "
        f"| {rank0.get('host_mib', 0):.0f} / {rank0.get('disk_mib', 0):.0f} "
        f"| {tps:.1f} | {result['first_failing_layers'] or '-'} |"
    )


def estimated_links(args: argparse.Namespace, psi: int, gradients: bool) -> dict[str, Any]:
    """zero-estimate's bytes per rank per step over each offload link for this run."""
    from zero_core.estimate.command import main as zero_estimate

    argv = [
        "--params", str(psi), "--world-size", str(args.nproc), "--dtype", "fp32",
        "--offload-optimizer", "disk", "--offload-params", "disk", "--bucket-numel",
        str(args.bucket_numel), "--prefetch-numel", str(args.prefetch_numel), "--json",
        *([] if gradients else ["--no-offload-gradients"]),
    ]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        zero_estimate(argv)
    return json.loads(out.getvalue())["3"]["links"]  # type: ignore[no-any-return]


def link_row(args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """Measured against estimated bytes per rank per step over host <-> disk (rank 0)."""
    best = result["best"]
    if result["variant"] not in DISK_VARIANTS or best is None:
        return None
    measured = best["ranks"][0].get("disk_bytes_last_step")
    links = estimated_links(args, best["parameters"], result["variant"] == "ours-3-disk")
    read, written = links["disk_to_host"], links["host_to_disk"]
    down = links["device_to_host"]["total"]
    up = links["host_to_device"]["total"]
    got = (
        f"{measured['read'] / MIB:,.0f} / {measured['written'] / MIB:,.0f}" if measured else "- / -"
    )
    return (
        f"| {result['variant']} | {result['layers']} | {got} "
        f"| {read['total'] / MIB:,.0f} / {written['total'] / MIB:,.0f} "
        f"(without parameter writes {(written['total'] - written['parameters']) / MIB:,.0f}) "
        f"| {down / MIB:,.0f} / {up / MIB:,.0f} |"
    )


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    lines = [
        "# Offload: the largest model under a memory cap (ZeRO-Infinity)",
        "",
        f"Generated by `python -m tools.offload.bench {' '.join(sys.argv[1:])}`.",
        "",
        f"Cap: RLIMIT_AS = address space after start-up + {args.cap_mib} MiB, per rank, "
        f"{args.nproc} ranks (gloo), GPT width {args.width}, {args.heads} heads, context "
        f"{args.context}, one sequence per rank, float32, AdamW, bucket_numel "
        f"{args.bucket_numel}, prefetch_numel {args.prefetch_numel} (ours), "
        f"offload_sub_group_numel {args.sub_group_numel}, "
        f"{args.threads} thread(s) per rank; "
        + ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
        + ". Model states: 16 bytes per parameter for the whole model. ours-3-disk: "
        "offload_optimizer=disk and offload_params=disk, gradients following the optimizer "
        "to disk; ours-3-disk-grads-on-device: the same with offload_gradients=False. "
        "deepspeed-3-cpu: DeepSpeed's stage 3 "
        "with offload_optimizer and offload_param on cpu (on a CPU-only machine that is the "
        "same memory; its NVMe tier needs libaio, absent here), the same torch AdamW.",
        "",
        "| variant | largest (layers) | model states | RSS / VM increase, MiB (rank 0) "
        "| host / disk, MiB (rank 0) | tokens/s | first failing layers |",
        "|---|---|---|---|---|---|---|",
        *(row(args, r) for r in results),
    ]
    links = [line for line in (link_row(args, r) for r in results) if line is not None]
    if links:
        lines += [
            "",
            "Bytes per rank per step over the offload links, MiB: swap files read / written by "
            "the last probe step (rank 0; the engine's counters, which do not count the "
            "parameter shards' writes after the step) beside zero-estimate's host <-> disk "
            "(disk -> host / host -> disk) and device <-> host (device -> host / host -> "
            "device; on a CPU-only machine these are the same memory and move nothing).",
            "",
            "| variant | layers | measured read / written | estimated read / written "
            "| estimated device -> host / host -> device |",
            "|---|---|---|---|---|",
            *links,
        ]
    return "\n".join(lines) + "\n"


def deepspeed_available() -> bool:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, env=env)
    return done.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cap-mib", type=int, default=1536)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-numel", type=int, default=2**20)
    p.add_argument("--sub-group-numel", type=int, default=2**19)
    p.add_argument("--prefetch-numel", type=int, default=2**22, help="ours: stage 3's window")
    p.add_argument(
        "--first-layers", nargs="*", default=[], metavar="VARIANT=LAYERS",
        help="where a variant's search starts (default: from the paper's formula)",
    )  # fmt: skip
    p.add_argument("--probe-steps", type=int, default=3)
    p.add_argument("--probe-timeout", type=int, default=900)
    p.add_argument("--max-probes", type=int, default=6)
    p.add_argument("--minutes", type=float, default=50.0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--offload-dir", type=Path, default=Path(tempfile.gettempdir()) / "zero-offload")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = p.parse_args()
    args.offload_dir.mkdir(parents=True, exist_ok=True)
    if "deepspeed-3-cpu" in args.variants and not deepspeed_available():
        print("[offload] deepspeed does not import: deepspeed-3-cpu left out", file=sys.stderr)
        args.variants = [v for v in args.variants if v != "deepspeed-3-cpu"]
    deadline = time.time() + 60 * args.minutes
    results = []
    for k, variant in enumerate(args.variants):
        share = (deadline - time.time()) / (len(args.variants) - k)
        results.append(largest(args, variant, time.time() + share))
    raw = args.out / "offload-json"
    raw.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    (raw / "headline.json").write_text(
        json.dumps({"settings": settings, "results": results}, indent=1)
    )
    text = report(args, results)
    print(text)
    write_report(args.out / "offload.md", text)


def write_report(target: Path, text: str) -> None:
    """``text`` into ``target``, followed by whatever ``target`` holds below KEPT (runs
    measured by hand, which a bench run must not erase)."""
    if target.exists() and KEPT in target.read_text():
        text += "\n" + KEPT + target.read_text().split(KEPT, 1)[1]
    target.write_text(text)


if __name__ == "__main__":
    main()
