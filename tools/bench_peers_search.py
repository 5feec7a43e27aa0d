"""The whole peer benchmark (``bench_peers.py --all``): the launches, then the largest-model
search, then docs/benchmarks/peers.md and its charts.

Launches: N = 2 and 4, sizes 20m and 100m (bench_peers.SIZES), every variant, each launch a
``zero-launch -n N python tools/bench_peers.py ...`` of its own; the 20m launches also run our
engines with deterministic reductions (``ours-*-det``), for the cost of determinism.

Largest model (N = 4; DDP, our stages 1-3, FSDP2): GPTs of width ``SEARCH_WIDTH`` and a
growing number of layers; each probe is its own launch that trains 2 steps (``--probe``; the
second step is the first with gradients and optimizer states both held) with one sequence
per rank. Memory is capped per rank: after ``zero_comm.init`` each rank sets
``RLIMIT_AS`` (address space) to its current size plus ``--search-budget-mib``, so an
allocation past the cap fails inside that rank (``PROBE-OOM``) and zero-launch stops the
others; nothing else on the machine is at risk. Address space is a little more than resident
memory (reserved, untouched pages count), so the cap is strict; the successful probes
record both. A probe whose paper model-state bytes alone exceed the budget fails by that
estimate, without running. The search per variant starts at the layer count that the paper's
formula puts at ~70% of the budget, grows (x1.5) or shrinks (/1.5) until it brackets the
limit, then bisects until the bracket is within 1/8 of the answer, at most ``MAX_PROBES``
probes, within ``--search-minutes`` for all variants.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_peers_report import paper_model_states_mib, write_docs

from zero_models.gpt import GPTConfig

TOOL = Path(__file__).resolve().parent / "bench_peers.py"
LAUNCHER = (sys.executable, "-m", "zero_comm.launch")  # zero-launch
# (size, N, sequences per rank): one sequence at 100M keeps the whole run under ~45 minutes
LAUNCHES = (("20m", 2, 2), ("100m", 2, 1), ("20m", 4, 2), ("100m", 4, 1))
SEARCH_VARIANTS = ("ddp", "ours-1", "ours-2", "ours-3", "fsdp2")
SEARCH_WIDTH, SEARCH_HEADS, SEARCH_CONTEXT, SEARCH_N = 1024, 16, 128, 4
MAX_PROBES = 7
# glibc's dynamic mmap threshold rises to the size of the largest block freed (up to 32 MiB),
# after which blocks below it come from the heap and stay resident when freed: a gathered
# 16 MiB parameter, freed and gathered again, inflated our stage 3's resident memory by 2x
# (1389 -> 666 MiB peak at 76M parameters, N = 4; DDP unchanged). A fixed threshold gives
# every variant the same allocator; the arena cap keeps address space close to RSS.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
PROBE_TIMEOUT_S = 420


def search_config(layers: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=256,
        context=SEARCH_CONTEXT,
        layers=layers,
        heads=SEARCH_HEADS,
        width=SEARCH_WIDTH,
    )


def launch_command(
    size: str, n: int, batch: int, json_path: Path, args: argparse.Namespace
) -> list[str]:
    variants = [
        "ours-0",
        "ours-1",
        "ours-2",
        "ours-3",
        "ddp",
        "zero-redundancy",
        "fsdp2",
        "deepspeed-1",
        "deepspeed-2",
        "deepspeed-3",
    ]
    if size == "20m":
        variants += ["ours-0-det", "ours-1-det", "ours-2-det", "ours-3-det"]
    return [
        *LAUNCHER,
        "-n",
        str(n),
        sys.executable,
        str(TOOL),
        "--size",
        size,
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(batch),
        "--variants",
        *variants,
        "--json",
        str(json_path),
    ]


def probe(variant: str, layers: int, budget_mib: int) -> dict[str, Any]:
    """One probe: {"ok": bool, "how": "ran" | "estimate" | "oom" | "error: ...", ...}."""
    config = search_config(layers)
    paper = paper_model_states_mib(variant, config.num_params, SEARCH_N) or 0.0
    record: dict[str, Any] = {
        "variant": variant,
        "layers": layers,
        "parameters": config.num_params,
        "paper_model_states_mib": paper,
    }
    if paper > budget_mib:
        return {**record, "ok": False, "how": "estimate", "seconds": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        command = [
            *LAUNCHER,
            "-n",
            str(SEARCH_N),
            sys.executable,
            str(TOOL),
            "--probe",
            variant,
            "--width",
            str(SEARCH_WIDTH),
            "--heads",
            str(SEARCH_HEADS),
            "--context",
            str(SEARCH_CONTEXT),
            "--layers",
            str(layers),
            "--batch",
            "1",
            "--budget-mib",
            str(budget_mib),
            "--json",
            str(out),
        ]
        env = {**os.environ, **MALLOC_ENV}
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return {**record, "ok": False, "how": "timeout", "seconds": PROBE_TIMEOUT_S}
        seconds = time.perf_counter() - started
        if done.returncode == 0 and out.exists():
            return {**record, **json.loads(out.read_text()), "how": "ran", "seconds": seconds}
        oom = "PROBE-OOM" in done.stderr or "Cannot allocate memory" in done.stderr
        phases = sorted(
            {
                line.split("PROBE-OOM in ")[1].split(" (")[0]
                for line in done.stderr.splitlines()
                if "PROBE-OOM in " in line
            }
        )
        tail = done.stderr.strip().splitlines()[-3:]
        return {
            **record,
            "ok": False,
            "how": ("oom in " + ", ".join(phases) if phases else "oom")
            if oom
            else "error: " + " | ".join(tail),
            "seconds": seconds,
        }


def search_layers(
    run_probe: Callable[[int], dict[str, Any]],
    guess: int,
    *,
    max_probes: int,
    deadline: float,
    label: str,
    retry_errors: bool = False,
) -> tuple[int, int, list[dict[str, Any]]]:
    """The most layers for which ``run_probe(layers)["ok"]``: from ``guess``, grow (x1.5)
    or shrink (/1.5) until a probe brackets the limit, then bisect until the bracket is
    within 1/8 of the answer, at most ``max_probes`` probes before ``deadline``. Returns
    (most layers that ran, fewest that failed or 0, every probe). With ``retry_errors``
    a probe that failed other than by memory is run once more, so that noise is not read
    as capacity."""
    lo, hi = 0, 0
    probes: list[dict[str, Any]] = []
    layers = guess
    while len(probes) < max_probes and time.time() < deadline:
        result = run_probe(layers)
        if retry_errors and not result["ok"] and result["how"].startswith("error"):
            probes.append(result)
            result = {**run_probe(layers), "retry": True}
        probes.append(result)
        print(
            f"[{label}] {result.get('variant', '')} {layers} layers "
            f"({result['parameters'] / 1e6:.0f}M): {'ok' if result['ok'] else 'fails'} "
            f"({result['how'][:160]}, {result['seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        if result["ok"]:
            lo = layers
        else:
            hi = layers
        if hi and hi - lo <= max(1, lo // 8):
            break
        if not hi:
            layers = math.ceil(layers * 1.5)
        elif not lo:
            layers = max(1, math.floor(layers / 1.5))
            if layers >= hi:
                break
        else:
            layers = (lo + hi) // 2
    return lo, hi, probes


def largest(variant: str, budget_mib: int, deadline: float) -> dict[str, Any]:
    """The most layers of width SEARCH_WIDTH that ``variant`` trains on N = 4 in the budget."""
    per_layer = search_config(2).num_params - search_config(1).num_params
    bytes_per_param = (paper_model_states_mib(variant, 1, SEARCH_N) or 16 / 2**20) * 2**20
    guess = max(1, int(0.7 * budget_mib * 2**20 / (bytes_per_param * per_layer)))
    # A crash (a C++ allocation under the cap in a helper thread, a peer's teardown) is
    # retried once, so noise is not read as capacity.
    lo, hi, probes = search_layers(
        lambda layers: probe(variant, layers, budget_mib),
        guess,
        max_probes=MAX_PROBES,
        deadline=deadline,
        label="search",
        retry_errors=True,
    )
    return {
        "variant": variant,
        "layers": lo,
        "parameters": search_config(lo).num_params if lo else 0,
        "first_failing_layers": hi or None,
        "probes": probes,
        "converged": bool(lo and hi and hi - lo <= max(1, lo // 8)),
    }


def run_all(args: argparse.Namespace) -> None:
    out: Path = args.out
    raw = out / "peers-json"
    raw.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if not args.report_only:
        for size, n, batch in LAUNCHES if not args.search_only else ():
            path = raw / f"peers-{size}-n{n}.json"
            command = launch_command(size, n, batch, path, args)
            print("[bench] " + " ".join(command), file=sys.stderr, flush=True)
            t0 = time.time()
            done = subprocess.run(command)
            print(
                f"[bench] {size} N={n}: exit {done.returncode}, {time.time() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        deadline = time.time() + 60 * args.search_minutes
        results = []
        for k, variant in enumerate(SEARCH_VARIANTS):
            share = (deadline - time.time()) / (len(SEARCH_VARIANTS) - k)
            results.append(largest(variant, args.search_budget_mib, time.time() + share))
        search = {
            "world_size": SEARCH_N,
            "width": SEARCH_WIDTH,
            "heads": SEARCH_HEADS,
            "context": SEARCH_CONTEXT,
            "batch_per_rank": 1,
            "budget_mib_per_rank": args.search_budget_mib,
            "limit": "RLIMIT_AS = address space after zero_comm.init + budget, per rank, over "
            "the build and the 2 steps; " + ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
            "results": results,
        }
        (raw / "largest-n4.json").write_text(json.dumps(search, indent=1))
        if args.search_only and (raw / "run.json").exists():
            previous = json.loads((raw / "run.json").read_text())
            previous["search_command"] = " ".join(getattr(sys, "orig_argv", sys.argv))
            (raw / "run.json").write_text(json.dumps(previous))
        else:
            (raw / "run.json").write_text(
                json.dumps(
                    {
                        "command": " ".join(getattr(sys, "orig_argv", sys.argv)),
                        "wall_s": time.time() - started,
                    }
                )
            )
    write_docs(out, raw)
