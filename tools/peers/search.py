"""The whole peer benchmark (``python -m tools.peers.bench --all``): the launches, then the
largest-model search, then docs/benchmarks/peers.md and its charts.

Launches: N = 2 and 4, sizes 20m and 100m (tools.peers.bench.SIZES), every variant, each launch a
``zero-launch -n N python -m tools.peers.bench ...`` of its own; the 20m launches also run our
engines with deterministic reductions (``ours-*-det``), for the cost of determinism.

Largest model (N = 4; DDP, our stages 1-3, FSDP2, DeepSpeed ZeRO 1-3), twice: without
activation checkpointing (``largest-n4.json``) and with every block checkpointed the same
way in every variant (``--checkpoint full``, tools/peers/trainers.py; ``largest-n4-checkpoint
.json``). GPTs of width ``SEARCH_WIDTH`` and a
growing number of layers; each probe is its own launch that trains 2 steps (``--probe``; the
second step is the first with gradients and optimizer states both held) with one sequence
per rank. Memory is capped per rank: after ``zero_comm.init`` each rank sets
``RLIMIT_AS`` (address space) to its current size plus ``--search-budget-mib``, so an
allocation past the cap fails inside that rank (``PROBE-OOM``) and zero-launch stops the
others; nothing else on the machine is at risk. Address space is a little more than resident
memory (reserved, untouched pages count), so the cap is strict; the successful probes
record both. A probe whose paper model-state bytes alone exceed the budget fails by that
estimate, without running. The search per variant starts at the layer count that the paper's
formula puts at ~70% of the budget, grows (x1.5) or shrinks (/1.5) until it brackets the limit,
then bisects until the bracket is one layer wide (the goals are ratios of 1.15x, which a
bracket of 1/8 cannot tell apart), at most ``MAX_PROBES`` probes, within ``--search-minutes``
for all variants and both settings together. With checkpointing, a variant's search starts one
step (x1.125) above its answer without, and grows by x1.125: checkpointing at one sequence of
128 tokens frees ~8 MiB per block, so the answer moves by ~10%, and a finer step finds it in
fewer probes.

After the search, tools/peers/scaling.py (N = 1, 2, 4; docs/benchmarks/scaling.md) unless
``--skip-scaling``; ``--scaling-only`` runs that alone; ``--skip-search`` leaves the
search out (the report keeps the search JSON already in peers-json/).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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

from tools.common.provenance import git_head
from tools.peers.report import (
    GOAL_PREFIX,
    SEARCH_FILES,
    TARGETS,
    paper_model_states_mib,
    write_docs,
)
from zero_models.gpt import GPTConfig

# Run as modules (python -m), found as this process found its own: from the working folder
# or PYTHONPATH, which the launches inherit.
BENCH = "tools.peers.bench"
SCALING = "tools.peers.scaling"
LAUNCHER = (sys.executable, "-m", "zero_comm.launch")  # zero-launch
# (size, N, sequences per rank, rounds): one sequence at 100M keeps the launches under ~45
# minutes. `--rounds` overrides every launch's, the goal launches' too.
LAUNCHES = (("20m", 2, 2, 3), ("100m", 2, 1, 3), ("20m", 4, 2, 3), ("100m", 4, 1, 3))
# The goal rows (tools.peers.report.TARGETS: ours-0..3 and ours-3-in-bwd against DDP) again,
# in launches of their own, where the full launch cannot tell a goal: a 19M step is 0.5-0.8
# s, and in the 16-variant launch a variant's block and its round's DDP block are up to two
# minutes apart. There, at c5678fa, one round moved a median ratio by 0.05-0.10, the goals'
# whole margin (3-round cells against 9-round A/Bs of the same code: 1.10 -> 0.97, 1.15 ->
# 1.10), and 7 rounds at 3f1eb96 (AMD) still spread 0.70-1.44 per round. With six variants
# a round is ~40 s, so 15 rounds cost what 5 of the full launch do. 101M N=2 blocks are ~20
# s, yet 4 rounds spread as widely (0.90-1.23 at 5b16ff2): 10 (~45 min on the AMD machine;
# the 95% interval of a median is then its 2nd to 9th round). The report judges these goals
# from these launches (peers-json/goal-rows-*); `--goal-rows-only` runs just them.
GOAL_LAUNCHES = (("20m", 2, 2, 15), ("100m", 2, 1, 10), ("20m", 4, 2, 15))
GOAL_VARIANTS = ("ddp", *TARGETS)
SEARCH_VARIANTS = (
    "ddp", "ours-1", "ours-2", "ours-3", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3",
    "ours-3-in-bwd", "fsdp2-in-bwd",
)  # fmt: skip
SEARCH_WIDTH, SEARCH_HEADS, SEARCH_CONTEXT, SEARCH_N = 1024, 16, 128, 4
MAX_PROBES = 8
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


def peers_launch(n: int, options: list[str]) -> list[str]:
    """``zero-launch -n n python -m tools.peers.bench OPTIONS``: one launch of tools.peers.bench
    (its ranks build and time every variant in ``options`` in one process each)."""
    return [*LAUNCHER, "-n", str(n), sys.executable, "-m", BENCH, *options]


def run_launch(command: list[str], label: str, env: dict[str, str] | None = None) -> int:
    """Run one launch, echoing the command and, when done, its exit status and duration;
    its output goes to this process's."""
    print("[bench] " + " ".join(command), file=sys.stderr, flush=True)
    started = time.time()
    done = subprocess.run(command, env=None if env is None else {**os.environ, **env})
    print(
        f"[bench] {label}: exit {done.returncode}, {time.time() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return done.returncode


LAUNCH_VARIANTS = (
    "ours-0", "ours-1", "ours-2", "ours-3", "ours-3-in-bwd", "ddp", "zero-redundancy", "fsdp2",
    "fsdp2-in-bwd", "deepspeed-1", "deepspeed-2", "deepspeed-3",
)  # fmt: skip
DETERMINISTIC_VARIANTS = ("ours-0-det", "ours-1-det", "ours-2-det", "ours-3-det")
# Launches whose variants run in several processes, each part with DDP so that every ratio
# is to a DDP timed in the same rounds: the ten variants of 101M on 4 ranks in one process
# each were killed by the kernel's out-of-memory killer three times (012be00, d70e610,
# 0e7c277; 23.5 GiB, 6 GB per rank at the kill). The cause was our engines' leak (each
# kept its model and gradients alive after close, fixed since); the split keeps the
# margin: one process per rank holds what every variant before it left in its heap.
LAUNCH_PARTS: dict[tuple[str, int], tuple[tuple[str, ...], ...]] = {
    ("100m", 4): (
        ("ours-0", "ours-1", "ours-2", "ours-3", "ours-3-in-bwd", "ddp", "zero-redundancy"),
        ("ddp", "fsdp2", "fsdp2-in-bwd", "deepspeed-1", "deepspeed-2", "deepspeed-3"),
    ),
}


def launch_variants(size: str, n: int) -> tuple[tuple[str, ...], ...]:
    """The variants of the launch (size, N), one tuple per process that runs them."""
    every = LAUNCH_VARIANTS + (DETERMINISTIC_VARIANTS if size == "20m" else ())
    return LAUNCH_PARTS.get((size, n), (every,))


def launch_command(
    size: str, n: int, batch: int, rounds: int, json_path: Path, args: argparse.Namespace,
    variants: tuple[str, ...],
) -> list[str]:  # fmt: skip
    """The launch (size, N) with ``rounds`` rounds unless ``--rounds`` was given."""
    rounds = rounds if args.rounds is None else args.rounds
    options = ["--size", size, "--steps", str(args.steps), "--rounds", str(rounds)]
    options += ["--warmup", str(args.warmup), "--batch", str(batch), "--variants", *variants]
    return peers_launch(n, [*options, "--json", str(json_path)])


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One launch's report from the reports of its parts (``LAUNCH_PARTS``): the first
    part's fields, every part's rows (a variant in several parts, DDP, from the first part
    that ran it), each row with the median DDP step of its own part
    (``ddp_median_step_s``: its ratios are to that DDP), the parts' commands and the sum of
    their wall times."""
    merged = {**parts[0], "results": [], "part_commands": [p["command"] for p in parts]}
    for part in parts:
        ddp = next((r for r in part["results"] if r["variant"] == "ddp"), None)
        for row in part["results"]:
            if all(row["variant"] != r["variant"] for r in merged["results"]):
                ddp_median = None if ddp is None else ddp["median_step_s"]
                merged["results"].append({**row, "ddp_median_step_s": ddp_median})
    merged["wall_s"] = sum(p.get("wall_s", 0.0) for p in parts)
    merged["sources_changed_during_run"] = any(p["sources_changed_during_run"] for p in parts)
    merged["deepspeed_error"] = next(
        (p["deepspeed_error"] for p in parts if p.get("deepspeed_error")), None
    )
    return merged


def run_peer_launch(
    size: str, n: int, batch: int, rounds: int, path: Path, args: argparse.Namespace,
    variants: tuple[str, ...] | None = None,
) -> int:  # fmt: skip
    """Run the launch (size, N) in its parts (of ``variants`` in one part, if given) and
    write its report to ``path``; the exit status of the first part that failed (``path``
    is then left as it was), else 0."""
    parts = launch_variants(size, n) if variants is None else (variants,)
    if len(parts) == 1:
        command = launch_command(size, n, batch, rounds, path, args, parts[0])
        return run_launch(command, f"{size} N={n}")
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, variants in enumerate(parts, 1):
            part_path = Path(tmp) / f"part-{k}.json"
            label = f"{size} N={n}, part {k} of {len(parts)}"
            command = launch_command(size, n, batch, rounds, part_path, args, variants)
            code = run_launch(command, label)
            if code:
                return code
            reports.append(json.loads(part_path.read_text()))
    path.write_text(json.dumps(merge_parts(reports), indent=1))
    return 0


def probe(variant: str, layers: int, budget_mib: int, checkpoint: str = "none") -> dict[str, Any]:
    """One probe: {"ok": bool, "how": "ran" | "estimate" | "oom" | "error: ...", ...}."""
    config = search_config(layers)
    paper = paper_model_states_mib(variant, config.num_params, SEARCH_N) or 0.0
    record: dict[str, Any] = {
        "variant": variant,
        "checkpoint": checkpoint,
        "layers": layers,
        "parameters": config.num_params,
        "paper_model_states_mib": paper,
    }
    if paper > budget_mib:
        return {**record, "ok": False, "how": "estimate", "seconds": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        command = peers_launch(
            SEARCH_N,
            [
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
                "--checkpoint",
                checkpoint,
                "--json",
                str(out),
            ],
        )
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


def bracketed(lo: int, hi: int, tolerance: float) -> bool:
    """Whether ``lo`` ran and ``hi`` failed within ``tolerance`` of ``lo`` (0: adjacent)."""
    return bool(lo and hi and hi - lo <= max(1, math.floor(lo * tolerance)))


def search_layers(
    run_probe: Callable[[int], dict[str, Any]],
    guess: int,
    *,
    max_probes: int,
    deadline: float,
    label: str,
    retry_errors: bool = False,
    growth: float = 1.5,
    tolerance: float = 1 / 8,
) -> tuple[int, int, list[dict[str, Any]]]:
    """The most layers for which ``run_probe(layers)["ok"]``: from ``guess``, grow (x``growth``)
    or shrink (/``growth``) until a probe brackets the limit, then bisect until the bracket is
    within ``tolerance`` of the answer (0: one layer wide), at most ``max_probes`` probes
    before ``deadline``. Returns
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
        if hi and bracketed(lo, hi, tolerance):
            break
        if not hi:
            layers = max(layers + 1, math.ceil(layers * growth))
        elif not lo:
            layers = max(1, min(layers - 1, math.floor(layers / growth)))
            if layers >= hi:
                break
        else:
            layers = (lo + hi) // 2
    return lo, hi, probes


def first_guess(variant: str, budget_mib: int) -> int:
    """The layers whose paper model states take ~70% of the budget: where a search starts."""
    per_layer = search_config(2).num_params - search_config(1).num_params
    bytes_per_param = (paper_model_states_mib(variant, 1, SEARCH_N) or 16 / 2**20) * 2**20
    return max(1, int(0.7 * budget_mib * 2**20 / (bytes_per_param * per_layer)))


def time_share(seconds_left: float, weights: list[int]) -> float:
    """The seconds the first of the searches left gets: ``seconds_left`` split in proportion
    to ``weights`` (each search's first guess, in layers: a probe's time grows with the
    model, so an even split left the largest models' last probes unrun). A search with
    checkpointing starts from the answer without it instead; the guess stands in for it,
    as that answer was within 1.4x of the guess in every variant (peers.md, 5de5451)."""
    return seconds_left * weights[0] / sum(weights)


def largest(
    variant: str,
    budget_mib: int,
    deadline: float,
    checkpoint: str = "none",
    without_checkpoint: int = 0,
) -> dict[str, Any]:
    """The most layers of width SEARCH_WIDTH that ``variant`` trains on N = 4 in the budget;
    ``without_checkpoint``: the answer of the search without checkpointing (0: unknown),
    where a search with checkpointing starts (module docstring)."""
    guess, growth = first_guess(variant, budget_mib), 1.5
    if checkpoint != "none" and without_checkpoint:
        guess, growth = max(without_checkpoint + 1, math.ceil(without_checkpoint * 1.125)), 1.125
    # A crash (a C++ allocation under the cap in a helper thread, a peer's teardown) is
    # retried once, so noise is not read as capacity.
    lo, hi, probes = search_layers(
        lambda layers: probe(variant, layers, budget_mib, checkpoint),
        guess,
        max_probes=MAX_PROBES,
        deadline=deadline,
        label=f"search, checkpoint {checkpoint}",
        retry_errors=True,
        growth=growth,
        tolerance=0.0,
    )
    return {
        "variant": variant,
        "checkpoint": checkpoint,
        "layers": lo,
        "parameters": search_config(lo).num_params if lo else 0,
        "first_failing_layers": hi or None,
        "probes": probes,
        "converged": bracketed(lo, hi, 0.0),
    }


def search_variants(args: argparse.Namespace) -> list[str]:
    """SEARCH_VARIANTS, or ``--search-variants``; DeepSpeed's left out where it is not installed."""
    variants = list(args.search_variants or SEARCH_VARIANTS)
    if importlib.util.find_spec("deepspeed") is None:
        left_out = [v for v in variants if v.startswith("deepspeed")]
        if left_out:
            print(f"[search] deepspeed is not installed: {left_out} left out", file=sys.stderr)
        variants = [v for v in variants if not v.startswith("deepspeed")]
    return variants


def run_search(args: argparse.Namespace, raw: Path) -> None:
    """Both searches (``--search-checkpoint``: none, full or both), one JSON each."""
    modes = ("none", "full") if args.search_checkpoint == "both" else (args.search_checkpoint,)
    variants = search_variants(args)
    deadline = time.time() + 60 * args.search_minutes
    answers: dict[str, int] = {}
    searches = [(mode, variant) for mode in modes for variant in variants]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    weights = [first_guess(variant, args.search_budget_mib) for _, variant in searches]
    for k, (mode, variant) in enumerate(searches):
        share = time_share(deadline - time.time(), weights[k:])
        found = largest(
            variant, args.search_budget_mib, time.time() + share, mode, answers.get(variant, 0)
        )
        if mode == "none":
            answers[variant] = found["layers"]
        results[mode].append(found)
    stamp = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_head": git_head(),
    }
    for mode in modes:
        rows = [{**result, **stamp} for result in results[mode]]
        if args.search_variants:
            rows = kept_results(raw / SEARCH_FILES[mode], rows, args.search_budget_mib)
        search = {
            "world_size": SEARCH_N,
            "width": SEARCH_WIDTH,
            "heads": SEARCH_HEADS,
            "context": SEARCH_CONTEXT,
            "batch_per_rank": 1,
            "checkpoint": mode,
            "budget_mib_per_rank": args.search_budget_mib,
            "limit": "RLIMIT_AS = address space after zero_comm.init + budget, per rank, over "
            "the build and the 2 steps; " + ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
            **stamp,
            "results": rows,
        }
        (raw / SEARCH_FILES[mode]).write_text(json.dumps(search, indent=1))


def kept_results(path: Path, found: list[dict[str, Any]], budget_mib: int) -> list[dict[str, Any]]:
    """``found`` (a search of some variants: ``--search-variants``) with the results of
    every other variant kept from the search JSON at ``path`` if it had the same budget,
    each stamped with the date and commit of the search that made it (the file's own, for
    results written before results carried theirs), in the file's variant order, new
    variants last."""
    if not path.exists():
        return found
    previous = json.loads(path.read_text())
    if previous.get("budget_mib_per_rank") != budget_mib:
        return found
    stamp = {key: previous[key] for key in ("date", "git_head") if key in previous}
    fresh = {result["variant"]: result for result in found}
    merged = [
        fresh.pop(result["variant"]) if result["variant"] in fresh else {**stamp, **result}
        for result in previous["results"]
    ]
    return merged + list(fresh.values())


def run_scaling(args: argparse.Namespace) -> None:
    """tools/peers/scaling.py with its defaults, writing into ``--out``."""
    command = [sys.executable, "-m", SCALING, "--out", str(args.out)]
    print("[bench] " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command)
    print(f"[bench] scaling: exit {done.returncode}", file=sys.stderr, flush=True)


def run_all(args: argparse.Namespace) -> None:
    out: Path = args.out
    raw = out / "peers-json"
    raw.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.scaling_only:
        run_scaling(args)
        return
    failed = []
    if not args.report_only:
        Kind = tuple[str, str, tuple[tuple[str, int, int, int], ...], tuple[str, ...] | None]
        kinds: tuple[Kind, ...] = (
            ("peers-", "", LAUNCHES, None),
            (GOAL_PREFIX, ", goal rows", GOAL_LAUNCHES, GOAL_VARIANTS),
        )
        if args.search_only:
            kinds = ()
        elif args.goal_rows_only:
            kinds = kinds[1:]
        for prefix, suffix, launches, variants in kinds:
            for size, n, batch, rounds in launches:
                path = raw / f"{prefix}{size}-n{n}.json"
                code = run_peer_launch(size, n, batch, rounds, path, args, variants)
                if code:
                    failed.append({"label": f"{size} N={n}{suffix}", "exit": code})
        partial = args.search_only or args.goal_rows_only
        if not (args.skip_search or args.goal_rows_only):
            run_search(args, raw)
        if not (args.skip_scaling or partial):
            run_scaling(args)
        if partial and (raw / "run.json").exists():
            # The full run's record stays; the partial run is named beside it (the report
            # says which tables it made).
            previous = json.loads((raw / "run.json").read_text())
            key = "search_command" if args.search_only else "goal_rows_command"
            previous[key] = " ".join(getattr(sys, "orig_argv", sys.argv))
            previous.pop("goal_rows_failed_launches", None)  # an earlier run's, not this one's
            if failed:
                previous["goal_rows_failed_launches"] = failed
            (raw / "run.json").write_text(json.dumps(previous))
        else:
            (raw / "run.json").write_text(
                json.dumps(
                    {
                        "command": " ".join(getattr(sys, "orig_argv", sys.argv)),
                        "wall_s": time.time() - started,
                        "failed_launches": failed,
                    }
                )
            )
    write_docs(out, raw)
