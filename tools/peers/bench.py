#!/usr/bin/env python
"""Our ZeRO stages against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, on one GPT.

    python -m tools.peers.bench --all                  # what `nox -s bench` runs: N = 2 and 4,
                                                       # both sizes, the largest-model search
                                                       # without and with checkpointing,
                                                       # docs/benchmarks/peers.md and PNGs,
                                                       # then tools/peers/scaling.py
    zero-launch -n 2 python -m tools.peers.bench --size 20m --json out.json   # one launch
    zero-launch -n 2 python -m tools.peers.bench --smoke --json out.json      # seconds
    zero-launch -n 4 python -m tools.peers.bench --probe ours-3 --layers 24 --budget-mib 1536
    zero-launch -n 2 python -m tools.peers.bench --smoke --checkpoint full    # every block
                                                       # recomputed in backward, all variants

One launch trains the same GPT (``--size``: SIZES below; vocabulary 256, the byte-level
default corpus of zero_models.data, next-token cross-entropy) with every variant of
tools/peers/trainers.py, fp32, AdamW, gloo, one torch thread per rank. Every variant sees the
same batches (``BatchSampler``, global batch ``--batch`` x N sequences) from the same initial
values (``GPT.initial_values(seed)``).

Variants run one at a time, in blocks: build on a fresh process group, ``--warmup`` untimed
steps, ``--steps`` timed steps, measure, destroy. A round runs every variant once; the order
alternates from round to round (a b c / c b a), so drift in the machine's load hits all alike.
Per variant:

- step time: each step starts after a world barrier; a step's time is the slowest rank's;
  a block's time is the median of its steps; reported: the median over rounds, and the ratio
  to DDP as the median over rounds of (variant / DDP of the same round).
- model-state bytes per rank: counted from tensors (tools.peers.trainers.StateBytes) just after
  the last backward (gradients held, optimizer states allocated), the largest rank.
- peak resident memory per rank: before each block the allocator is trimmed
  (``malloc_trim``), the process's peak RSS is reset (``/proc/self/clear_refs`` 5) and its RSS
  read; the figure is the block's peak RSS minus that baseline, i.e. the resident memory this
  variant added at its peak. All variants of a launch share one process, but only one variant
  is alive at a time, so the increase is this variant's alone. The largest rank and round.
- bytes communicated per step per rank: ring convention (zero_comm.stats). Ours: the
  engine communicator's ``stats``; peers: the hooked torch.distributed calls
  (tools/peers/comm_hooks.py).
- minor page faults per timed step (``getrusage``; the slowest-faulting rank, median over
  steps, then over rounds): a variant whose timed steps fault far more than its later ones
  is not measured in its steady state (WARMUP_STEPS).
- loss after ``warmup + steps`` steps (every block starts from the initial values), the mean
  over ranks; the same for every round, so rank 0's last round is reported.
- peak per phase: in the last timed step of each block, zero_core.MemoryTracker measures
  the resident high-water mark of "forward", "backward" and "step" (it trims the allocator
  and resets VmHWM at each phase start: milliseconds in one of the block's timed steps,
  whose median the other two decide; the block's peak above is the larger of the
  high-water mark before that step and these phase peaks). Reported per phase as the
  increase over the block's pre-build baseline, the largest rank and round.

``--checkpoint full`` checkpoints every transformer block of every variant the same way
(tools/peers/trainers.py says how); ``none`` (the default) keeps all activations.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import zero_comm
import zero_core
import zero_models
from tools.common.provenance import cpu_model, git_head, sources_digest
from tools.peers import comm_hooks
from zero_core.memory.host_heap import release_free_heap
from zero_models.data import BatchSampler, load_tokens
from zero_models.gpt import GPTConfig

SIZES = {
    "smoke": GPTConfig(context=32, layers=2, heads=2, width=32),
    "20m": GPTConfig(context=128, layers=6, heads=8, width=512),
    "100m": GPTConfig(context=128, layers=8, heads=16, width=1024),
}
MIB = 2**20
# Untimed steps per block: the timed ones are the steady state of every variant. DDP
# rebuilds its buckets after its first step and allocates them in its second; our engines
# give the heap's free pages back after each of their first two steps
# (zero_core.memory.host_heap.StepHeapRelease), which the next step faults in again: at 19M on
# 4 ranks, ~70 thousand minor faults a step at stage 0 and ~165 thousand at stage 3 in
# steps 2-3 against 0.3-25 thousand from step 4 on (the per-launch tables print the
# timed steps' faults, so a window that is not steady shows).
WARMUP_STEPS = 3
REPOSITORY = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ process memory
def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, VmSize, VmPeak); 0 if absent."""
    from zero_core.memory.proc_status import process_status_kib

    return process_status_kib(field) or 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def trim_allocator() -> None:
    gc.collect()
    release_free_heap()


def model_config(args: argparse.Namespace) -> GPTConfig:
    base = SIZES["smoke" if args.smoke else args.size]
    return base.with_overrides(
        layers=args.layers, width=args.width, heads=args.heads, context=args.context
    )


def import_deepspeed() -> str | None:
    """None if DeepSpeed imports on this CPU machine, else why not (the error, verbatim)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import importlib

        importlib.import_module("deepspeed")
    except Exception as exc:  # any failure of a peer's import is a finding, not a crash
        return f"import deepspeed failed: {type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------- one launch
def run_block(
    variant: str,
    world: zero_comm.Communicator,
    config: GPTConfig,
    args: argparse.Namespace,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    comm: zero_comm.Communicator,
) -> dict[str, Any]:
    """Build ``variant`` on ``comm``, train it ``warmup + steps`` steps, measure, destroy it;
    the last step's phases are measured by a zero_core.MemoryTracker (module docstring).

    ``comm`` is made by the caller and closed only at the end of the launch: a gloo group
    created just after another was destroyed can find the old group's addresses in the
    store and fail to connect (seen with torch 2.13), so the groups live on, with their
    staging buffers emptied."""
    from tools.peers.trainers import Hyper, make_trainer

    trim_allocator()
    world.barrier()
    base_kib = status_kib("VmRSS")
    reset_ok = reset_peak_rss()
    built = time.perf_counter()
    trainer = make_trainer(variant, config, args.seed, Hyper(), comm, args.batch, args.checkpoint)
    build_s = time.perf_counter() - built
    times: list[float] = []
    faults: list[int] = []  # minor page faults of this process per timed step
    losses: list[float] = []
    states = None
    last = len(batches) - 1
    tracker = zero_core.MemoryTracker("cpu")
    peak_before_kib = 0
    for step, (inputs, targets) in enumerate(batches):
        if step == args.warmup:
            trainer.comm_bytes_reset()
        tracked = step == last and reset_ok
        if tracked:
            peak_before_kib = status_kib("VmHWM")  # the tracker resets the high-water mark
        phase = tracker.phase if tracked else (lambda _name: contextlib.nullcontext())
        world.barrier()
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        with phase("forward"):
            loss = trainer.forward(inputs, targets)
        with phase("backward"):
            trainer.backward(loss)
        losses.append(float(loss.item()))
        del loss
        t1 = time.perf_counter()
        if step == last:
            states = trainer.state_bytes()
        t2 = time.perf_counter()
        with phase("step"):
            trainer.optimizer_step()
        t3 = time.perf_counter()
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        if step >= args.warmup:
            times.append((t1 - t0) + (t3 - t2))
            faults.append(usage1.ru_minflt - usage0.ru_minflt)
    comm_bytes, calls = trainer.comm_bytes()
    peak_kib = status_kib("VmHWM")
    if tracker.peaks:
        phase_kib = [p.peak_bytes // 1024 for p in tracker.history]
        peak_kib = max([peak_kib, peak_before_kib, *phase_kib])
    phase_peaks = {
        p.phase: {
            "increase_mib": (p.peak_bytes / 1024 - base_kib) / 1024,
            "start_increase_mib": (p.start_bytes / 1024 - base_kib) / 1024,
        }
        for p in tracker.history
    }
    trainer.close()
    del trainer, tracker
    comm.buffers.clear()
    trim_allocator()
    assert states is not None
    return {
        "variant": variant,
        "build_s": build_s,
        "step_s": times,
        "step_minor_faults": faults,
        "losses": losses,
        "state_bytes": {**states._asdict(), "model_states": states.model_states},
        "comm_bytes_per_step": comm_bytes / max(1, len(times)),
        "comm_calls_per_step": {k: v / max(1, len(times)) for k, v in calls.items()},
        "rss_base_mib": base_kib / 1024,
        "rss_peak_mib": peak_kib / 1024,
        "rss_increase_mib": (peak_kib - base_kib) / 1024 if reset_ok else None,
        "phase_peaks": phase_peaks,
    }


def run_rank(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    comm_hooks.install()  # before DeepSpeed is imported: it keeps references to the collectives
    torch.set_num_threads(args.threads)
    world = zero_comm.init("gloo", deterministic=False)
    # Our engines with deterministic (rank-ordered) reductions split from a second world.
    worlds = {False: world}
    if any(v.endswith("-det") for v in args.variants):
        worlds[True] = zero_comm.init("gloo", deterministic=True)
    rank, n = world.rank, world.world_size
    config = model_config(args).with_overrides(vocab_size=256)
    sources = sources_digest(zero_core, zero_comm, zero_models)

    def say(text: str) -> None:
        if rank == 0:
            print(f"[bench_peers] {text}", file=sys.stderr, flush=True)

    variants = list(args.variants)
    deepspeed_error = None
    if any(v.startswith("deepspeed") for v in variants):
        deepspeed_error = import_deepspeed()
        if deepspeed_error:
            say(f"DeepSpeed left out: {deepspeed_error}")
            variants = [v for v in variants if not v.startswith("deepspeed")]
    say(f"N={n}, GPT {config} ({config.num_params:,} parameters), variants {variants}")
    sampler = BatchSampler(
        load_tokens(None),
        context=config.context,
        global_batch=args.batch * n,
        dp_rank=rank,
        dp_size=n,
        seed=args.seed,
    )
    batches = [tuple(sampler.batch(step, 0)) for step in range(args.warmup + args.steps)]
    # A discarded warm-up block of each variant on the smoke GPT: lazy initialisations
    # (allocator arenas, DeepSpeed's JIT-built ops, gloo threads) land outside the measurements.
    comms: list[zero_comm.Communicator] = []
    smoke = SIZES["smoke"].with_overrides(vocab_size=256)
    for variant in variants:
        comms.append(worlds[variant.endswith("-det")].split(color=0))
        run_block(
            variant,
            world,
            smoke,
            args,
            [(x[:, : smoke.context], y[:, : smoke.context]) for x, y in batches[:2]],
            comms[-1],
        )
    say(f"warm-up blocks done in {time.perf_counter() - started:.0f} s")
    blocks: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for variant in order:
            if variant in failures:
                continue
            t0 = time.perf_counter()
            comms.append(worlds[variant.endswith("-det")].split(color=0))
            try:
                block = run_block(variant, world, config, args, batches, comms[-1])  # type: ignore[arg-type]
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                failures[variant] = f"{type(exc).__name__}: {exc}"
                say(f"{variant} failed: {failures[variant]}\n{traceback.format_exc()}")
                raise
            block["round"] = r
            blocks.append(block)
            say(
                f"round {r} {variant}: median step {statistics.median(block['step_s']):.3f} s, "
                f"loss {block['losses'][-1]:.4f}, block {time.perf_counter() - t0:.0f} s"
            )
    everyone: list[list[dict[str, Any]]] = world.all_gather_object(blocks)
    changed = sources_digest(zero_core, zero_comm, zero_models) != sources
    if rank == 0:
        report = summarize(everyone, variants, n, config, args)
        report.update(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(getattr(sys, "orig_argv", sys.argv)),
            machine=machine(),
            versions=versions(),
            git_head=git_head(),
            uncommitted=uncommitted(),
            sources=sources,
            sources_changed_during_run=changed,
            deepspeed_error=deepspeed_error,
            wall_s=time.perf_counter() - started,
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
            say(f"wrote {args.json}")
        from tools.peers.report import launch_table

        print(launch_table(report))
    for comm in comms:
        comm.close()
    if True in worlds:
        worlds[True].close()  # the world group is shared: the last close destroys it
    world.close()


def summarize(
    everyone: list[list[dict[str, Any]]],
    variants: list[str],
    n: int,
    config: GPTConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Rank 0: one row per variant from every rank's blocks."""
    from tools.peers.trainers import BUCKET_NUMEL

    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for per_rank in everyone:
        for block in per_rank:
            rounds.setdefault((block["variant"], block["round"]), []).append(block)

    def block_median(variant: str, r: int, key: str = "step_s") -> float:
        """The median over the block's timed steps of the largest rank's ``key``."""
        ranks = rounds[(variant, r)]
        largest = [max(column) for column in zip(*(b[key] for b in ranks), strict=True)]
        return float(statistics.median(largest))

    results = []
    for variant in variants:
        mine = sorted(r for v, r in rounds if v == variant)
        times = [block_median(variant, r) for r in mine]
        ratios = [
            block_median(variant, r) / block_median("ddp", r) for r in mine if ("ddp", r) in rounds
        ]
        blocks = [b for r in mine for b in rounds[(variant, r)]]
        last = rounds[(variant, mine[-1])]
        increases = [b["rss_increase_mib"] for b in blocks if b["rss_increase_mib"] is not None]
        phase_names = dict.fromkeys(p for b in blocks for p in b.get("phase_peaks", {}))
        phase_peaks = {
            name: {
                key: max(b["phase_peaks"][name][key] for b in blocks if name in b["phase_peaks"])
                for key in ("increase_mib", "start_increase_mib")
            }
            for name in phase_names
        }
        results.append(
            {
                "variant": variant,
                "median_step_s": statistics.median(times),
                "round_step_s": times,
                "ratio_to_ddp": statistics.median(ratios) if ratios else None,
                "round_ratios_to_ddp": ratios,
                "state_bytes": {
                    k: max(b["state_bytes"][k] for b in blocks) for k in blocks[0]["state_bytes"]
                },
                "rss_increase_mib": max(increases) if increases else None,
                "phase_peaks": phase_peaks,
                "rss_peak_mib": max(b["rss_peak_mib"] for b in blocks),
                "comm_bytes_per_step": max(b["comm_bytes_per_step"] for b in blocks),
                "comm_calls_per_step": last[0]["comm_calls_per_step"],
                "loss": statistics.fmean(b["losses"][-1] for b in last),
                "losses_rank0": last[0]["losses"],
                "build_s": statistics.median(b["build_s"] for b in blocks),
                "minor_faults_per_step": statistics.median(
                    block_median(variant, r, "step_minor_faults") for r in mine
                ),
            }
        )
    return {
        "world_size": n,
        "size": "smoke" if args.smoke else args.size,
        "model": {
            **{
                k: getattr(config, k)
                for k in ("vocab_size", "context", "layers", "heads", "width", "tie_weights")
            },
            "parameters": config.num_params,
        },
        "batch_per_rank": args.batch,
        "checkpoint": args.checkpoint,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "bucket_numel": BUCKET_NUMEL,
        "results": results,
    }


def machine() -> dict[str, Any]:
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "system": platform.platform(),
        "python": platform.python_version(),
    }


def uncommitted() -> list[str]:
    """Files of the checkout that differ from ``git_head`` (``git status --porcelain``)."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--", "tools", "packages"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPOSITORY,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in done.stdout.splitlines()]


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"torch": torch.__version__}
    for dist in ("deepspeed", "zero-comm", "zero-core", "zero-models"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# ------------------------------------------------------------------- search probes
def run_probe(args: argparse.Namespace) -> None:
    """Train ``--probe`` 2 steps under a per-rank address-space cap; exit 3 on out-of-memory."""
    from tools.peers.trainers import Hyper, make_trainer

    comm_hooks.install()
    torch.set_num_threads(args.threads)
    world = zero_comm.init("gloo", deterministic=False)
    config = model_config(args).with_overrides(vocab_size=256)
    sampler = BatchSampler(
        load_tokens(None, max_bytes=1 << 20),
        context=config.context,
        global_batch=args.batch * world.world_size,
        dp_rank=world.rank,
        dp_size=world.world_size,
        seed=args.seed,
    )
    # A smoke-size block first, so that code paged in on first use (libtorch's kernels, the
    # framework's modules) is resident before the baseline and not counted as the model's.
    smoke = SIZES["smoke"].with_overrides(vocab_size=256)
    warm = make_trainer(
        args.probe, smoke, args.seed, Hyper(), world.split(color=0), args.batch, args.checkpoint
    )
    for step in range(2):
        inputs, targets = sampler.batch(step, 0)
        warm.forward_backward(inputs[:, : smoke.context], targets[:, : smoke.context])
        warm.optimizer_step()
    warm.close()
    del warm
    trim_allocator()
    base_rss, base_vm = status_kib("VmRSS"), status_kib("VmSize")
    limit = (base_vm * 1024) + args.budget_mib * MIB
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))  # soft: lifted again to report
    comm = world.split(color=0)
    phase = "build"
    try:
        trainer = make_trainer(
            args.probe, config, args.seed, Hyper(), comm, args.batch, args.checkpoint
        )
        step_seconds = []
        disk_bytes = getattr(trainer, "disk_bytes", None)  # ours with a disk tier
        for step in range(args.probe_steps):
            if disk_bytes is not None and step == args.probe_steps - 1:
                trainer.disk_bytes_reset()  # the last step's swap traffic
            started = time.perf_counter()
            phase = f"forward/backward {step + 1}"
            trainer.forward_backward(*sampler.batch(step, 0))
            if step == 1:
                report = trainer.state_bytes()  # gradients held
                states = report.model_states
            phase = f"optimizer step {step + 1}"
            trainer.optimizer_step()
            step_seconds.append(time.perf_counter() - started)
        # The cap is for the build and the steps; the report (a small all-gather) is not
        # the model's memory, and failing it near the cap would read noise as capacity.
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        phase = "report"
        record = {
            "rss_increase_mib": (status_kib("VmHWM") - base_rss) / 1024,
            "vm_increase_mib": (status_kib("VmPeak") - base_vm) / 1024,
            "model_state_mib": states / MIB,
            # the steps after the first (which records stage 3's gather order)
            "step_seconds": step_seconds[1:],
            "host_mib": getattr(report, "host", 0) / MIB,
            "disk_mib": getattr(report, "disk", 0) / MIB,
            "disk_bytes_last_step": disk_bytes() if disk_bytes is not None else None,
        }
        everyone = world.all_gather_object(record)
    except (MemoryError, RuntimeError) as exc:
        text = str(exc).splitlines()[0][:300]
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"[rank {world.rank}] PROBE-OOM in {phase} ({Path(where.filename).name}:"
            f"{where.lineno}) {type(exc).__name__}: {text}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)  # the others are stuck in a collective: zero-launch stops them
    if world.rank == 0 and args.json:
        Path(args.json).write_text(
            json.dumps({"ok": True, "parameters": config.num_params, "ranks": everyone})
        )
    os._exit(0)  # skip teardown: the next probe starts at once


# ------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    from tools.peers.trainers import DEFAULT_VARIANTS, VARIANTS

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--all", action="store_true", help="the whole benchmark (runs launches)")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="with --all: rebuild docs from the JSON files of an earlier run",
    )
    p.add_argument(
        "--search-only", action="store_true", help="with --all: the largest-model search only"
    )
    p.add_argument(
        "--goal-rows-only",
        action="store_true",
        help="with --all: the goal-row launches only (tools.peers.search.GOAL_LAUNCHES); the "
        "other tables keep the JSON of the last full run",
    )
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="tiny GPT, seconds")
    p.add_argument("--size", choices=sorted(SIZES), default="20m")
    for name in ("layers", "width", "heads", "context"):
        p.add_argument(f"--{name}", type=int, help=f"override the size's {name}")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    p.add_argument(
        "--batch",
        type=int,
        default=2,
        help="sequences per rank per step (--all: 2 at 20m, 1 at 100m)",
    )
    p.add_argument(
        "--checkpoint",
        choices=("none", "full"),
        default="none",
        help="activation checkpointing of every block, every variant (tools.peers.trainers)",
    )
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="untimed steps per block")
    p.add_argument("--steps", type=int, default=3, help="timed steps per block")
    p.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds (default 3; --all: per launch, tools.peers.search.LAUNCHES)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="where rank 0 writes the results")
    p.add_argument("--probe", choices=VARIANTS, help="one search probe (see tools.peers.search)")
    p.add_argument("--budget-mib", type=int, default=1536, help="probe: memory per rank")
    p.add_argument("--probe-steps", type=int, default=2, help="probe: steps to train (>= 2)")
    p.add_argument(
        "--search-budget-mib",
        type=int,
        default=1536,
        help="--all: memory per rank for the largest-model search",
    )
    p.add_argument(
        "--search-minutes",
        type=float,
        default=65.0,
        help="--all: time budget of the whole search (both settings, every variant)",
    )
    p.add_argument(
        "--search-checkpoint",
        choices=("none", "full", "both"),
        default="both",
        help="--all: search without activation checkpointing, with it, or both",
    )
    p.add_argument(
        "--search-variants",
        nargs="+",
        choices=VARIANTS,
        help="--all: the variants searched (default: tools.peers.search.SEARCH_VARIANTS)",
    )
    p.add_argument(
        "--skip-scaling", action="store_true", help="--all: leave out tools/peers/scaling.py"
    )
    p.add_argument("--scaling-only", action="store_true", help="--all: tools/peers/scaling.py only")
    p.add_argument(
        "--skip-search", action="store_true",
        help="--all: leave out the largest-model search (the report keeps the last one's JSON)",
    )  # fmt: skip
    return p


def main() -> None:
    args = parser().parse_args()
    if args.all:
        from tools.peers.search import run_all

        run_all(args)
    elif args.probe:
        run_probe(args)
    else:
        args.rounds = 3 if args.rounds is None else args.rounds
        run_rank(args)


if __name__ == "__main__":
    main()
