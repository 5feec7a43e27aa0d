#!/usr/bin/env python
"""Time one training step of ZeRO stages 0 to 3, side by side, on the same model.

    zero-launch -n 2 python -m tools.micro.stages --json bench/stages-fp32.json
    zero-launch -n 2 python -m tools.micro.stages --dtype bf16 --json bench/stages-bf16.json
    zero-launch -n 2 python -m tools.micro.stages --deterministic both   # + native reductions
    zero-launch -n 2 python -m tools.micro.stages --stages 0 2 3 3-noprefetch

The model is an MLP of ``--layers`` Linear(width, width) layers with GELU between them
(5 x 2048 x 2048 + biases: 20.98M parameters), built once with a fixed seed; every engine
trains its own deep copy with AdamW (lr 1e-4) on the gloo backend. Each rank feeds its own
batch (``--batch`` x width, seeded by rank and step; every stage sees the same batches).

One step is what a training loop does:

    loss = engine(x).float().square().mean(); engine.backward(loss); engine.step()

timed on each rank from leaving a barrier (on the world communicator, not the engines') to
the end of ``step()``; a sample is the slowest rank's time, and its forward / backward
(which includes the gradient reduction) / step (optimizer and parameter all-gather) split.

All engines are built first, each on its own communicator (``comm.split``: its own buffer
pool, statistics and gloo connections), warmed up ``--warmup`` steps each, then timed for
``--rounds`` rounds of one step per engine, interleaved: stage order alternates 0 1 2 /
2 1 0 from round to round, so that drift in the machine's load hits every stage alike. The
ratio to stage 0 is the median over rounds of (this stage's time / stage 0's time in the
same round, same communicator mode). Medians, never means: a 2-core machine shared with
other work has a heavy tail of scheduler delays.

After timing, one more (untimed) step per engine takes ``memory_report()`` just after
``backward`` (when gradients are held: stage 0 frees its reduced gradients in ``step``)
and again after ``step``. The communication volume per step is the engine communicator's
``stats`` over the timed rounds divided by their number (the ring convention of
zero_comm.stats: 2 Ψ (N-1)/N for stages 0-2 on paper, 3 Ψ (N-1)/N for stage 3). The
barrier and the consistency check's small all-gathers are not counted there.

Finally every engine's ``full_state_dict`` is compared with stage 0's of the same mode:
with ``deterministic=True`` the engine promises bit-identical parameters.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import zero_comm
import zero_core
from tools.common.provenance import git_head, sources_digest
from zero_core.config.choices import SHORT_DTYPE_NAMES

DTYPES = {name: SHORT_DTYPE_NAMES[name] for name in ("fp32", "bf16")}  # no loss scaling here
MIB = 2**20
MEMORY_FIELDS = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "buffers",
    "comm_buffers",
)
PHASES = ("forward", "backward", "step")


def build_mlp(layers: int, width: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.GELU())
    return nn.Sequential(*modules)


class Case:
    """One engine under test: a stage and a communicator mode."""

    def __init__(self, variant: str, deterministic: bool, engine: zero_core.ZeroEngine) -> None:
        self.variant = variant  # "2", "3", "3-noprefetch"
        self.stage = int(variant.split("-")[0])
        self.deterministic = deterministic
        self.engine = engine
        self.samples: list[list[float]] = []  # per timed step: forward, backward, step
        self.faults: list[int] = []  # per timed step: minor page faults of this process
        self.last_faults = 0
        self.losses: list[float] = []  # every step this engine took, warm-up included

    @property
    def mode(self) -> str:
        return "det" if self.deterministic else "native"

    @property
    def name(self) -> str:
        return f"stage {self.variant} {self.mode}"

    def step(self, x: torch.Tensor) -> list[float]:
        """One training step; the seconds of its forward, backward and step parts."""
        engine = self.engine
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = engine(x).float().square().mean()
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        applied = engine.step()
        t3 = time.perf_counter()
        self.last_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if not applied:
            raise RuntimeError(f"{self.name}: step() did not apply the update")
        self.losses.append(float(loss.item()))
        return [t1 - t0, t2 - t1, t3 - t2]


def memory_mib(report: Any) -> dict[str, float]:
    out = {name: getattr(report, name) / MIB for name in MEMORY_FIELDS}
    out["model_states"] = report.model_states / MIB
    out["total"] = report.total / MIB
    return out


def batches(count: int, batch: int, width: int, rank: int, seed: int, dtype: torch.dtype) -> Any:
    """This rank's input of every step: different on every rank, the same for every stage."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + 1000 * rank + i + 1)
        out.append(torch.randn(batch, width, generator=g).to(dtype))
    return out


def slowest(comm: zero_comm.Communicator, mine: list[list[float]]) -> list[list[float]]:
    """Per sample, the parts of the rank whose total time was the largest."""
    everyone: list[list[list[float]]] = comm.all_gather_object(mine)
    return [max(column, key=sum) for column in zip(*everyone, strict=True)]


def parameter_diff(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> dict[str, Any]:
    equal = all(torch.equal(state[k], reference[k]) for k in reference)
    worst = max(float((state[k] - reference[k]).abs().max()) for k in reference)
    return {"bit_identical": equal, "max_abs_diff": worst}


# ---------------------------------------------------------------------------------- main
def run_rank(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    sources = sources_digest(zero_core, zero_comm)
    modes = {"true": [True], "false": [False], "both": [True, False]}[args.deterministic]
    worlds = {det: zero_comm.init("gloo", deterministic=det) for det in modes}
    world = worlds[modes[0]]
    rank, n = world.rank, world.world_size
    dtype = DTYPES[args.dtype]

    def say(text: str) -> None:
        if rank == 0:
            print(text, file=sys.stderr, flush=True)

    say(
        f"[bench] {world!r}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"dtype {args.dtype}, modes {['det' if m else 'native' for m in modes]}"
    )
    base = build_mlp(args.layers, args.width, args.seed)
    numel = sum(p.numel() for p in base.parameters())
    say(f"[bench] MLP {args.layers} x Linear({args.width}, {args.width}): {numel:,} parameters")

    steps = args.warmup + args.rounds + 1
    inputs = batches(steps, args.batch, args.width, rank, args.seed, dtype)

    cases: list[Case] = []
    subgroups: list[zero_comm.Communicator] = []
    built = time.perf_counter()
    for det in modes:
        for variant in args.stages:
            comm = worlds[det].split(color=0)
            subgroups.append(comm)
            model = copy.deepcopy(base)
            config = zero_core.ZeroConfig(
                stage=int(variant.split("-")[0]),
                param_dtype=dtype,
                bucket_numel=args.bucket_numel,
                prefetch_numel=0 if variant.endswith("-noprefetch") else args.prefetch_numel,
            )
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine = zero_core.initialize(model, optimizer, config, comm)
            cases.append(Case(variant, det, engine))
    del base
    say(f"[bench] built {len(cases)} engines in {time.perf_counter() - built:.1f} s")

    def round_order(i: int) -> list[Case]:
        return cases if i % 2 == 0 else cases[::-1]

    warm = time.perf_counter()
    for i in range(args.warmup):
        for case in round_order(i):
            world.barrier()
            case.step(inputs[i])
    say(f"[bench] warm-up ({args.warmup} steps each) {time.perf_counter() - warm:.1f} s")

    for case in cases:
        case.engine.comm.stats.reset()
    timed = time.perf_counter()
    for r in range(args.rounds):
        i = args.warmup + r
        for case in round_order(r):
            world.barrier()
            case.samples.append(case.step(inputs[i]))
            case.faults.append(case.last_faults)
    timed_s = time.perf_counter() - timed
    say(f"[bench] timed {args.rounds} rounds in {timed_s:.1f} s")
    comm_per_step = []
    for case in cases:
        counts = case.engine.comm.stats.as_dict()
        comm_per_step.append(
            {
                op: {key: value / args.rounds for key, value in entry.items()}
                for op, entry in counts.items()
                if entry["calls"]
            }
        )

    # One more step per engine, untimed, for the memory reports.
    memory: list[dict[str, dict[str, float]]] = []
    last = inputs[steps - 1]
    for case in cases:
        engine = case.engine
        loss = engine(last).float().square().mean()
        engine.backward(loss)
        after_backward = memory_mib(engine.memory_report())
        engine.step()
        case.losses.append(float(loss.item()))
        memory.append(
            {"after_backward": after_backward, "after_step": memory_mib(engine.memory_report())}
        )

    # Bit-identity against stage 0 of the same mode (collective: every rank calls it).
    states = [case.engine.full_state_dict(rank=0) for case in cases]
    agreement: list[dict[str, Any] | None] = []
    for case, state in zip(cases, states, strict=True):
        reference = next(
            (
                s
                for c, s in zip(cases, states, strict=True)
                if c.stage == 0 and c.deterministic == case.deterministic
            ),
            None,
        )
        if rank != 0 or reference is None:
            agreement.append(None)
            continue
        agreement.append(parameter_diff(state, reference))
    all_losses = world.all_gather_object([case.losses for case in cases])

    samples = [slowest(world, case.samples) for case in cases]
    faults = world.all_gather_object([case.faults for case in cases])
    changed = sources_digest(zero_core, zero_comm) != sources
    for comm in subgroups:
        comm.close()
    if rank == 0:
        results = []
        for k, case in enumerate(cases):
            totals = [sum(s) for s in samples[k]]
            zero = next(
                (
                    j
                    for j, c in enumerate(cases)
                    if c.stage == 0 and c.deterministic == case.deterministic
                ),
                None,
            )
            ratios = (
                [a / b for a, b in zip(totals, [sum(s) for s in samples[zero]], strict=True)]
                if zero is not None
                else []
            )
            losses_equal = zero is not None and all(
                per_rank[k] == per_rank[zero] for per_rank in all_losses
            )
            results.append(
                {
                    "stage": case.stage,
                    "variant": case.variant,
                    "deterministic": case.deterministic,
                    "median_step_s": statistics.median(totals),
                    "min_step_s": min(totals),
                    "max_step_s": max(totals),
                    "median_phase_s": {
                        phase: statistics.median(s[p] for s in samples[k])
                        for p, phase in enumerate(PHASES)
                    },
                    "ratio_to_stage0_median": statistics.median(ratios) if ratios else None,
                    "ratio_to_stage0_of_medians": (
                        statistics.median(totals) / statistics.median(sum(s) for s in samples[zero])
                        if zero is not None
                        else None
                    ),
                    "step_s": totals,
                    "phase_s": samples[k],
                    "minor_page_faults_per_step_median": [
                        statistics.median(per_rank[k]) for per_rank in faults
                    ],
                    "memory_mib": memory[k],
                    "comm_per_step": comm_per_step[k],
                    "params_vs_stage0": agreement[k],
                    "losses_equal_stage0_all_steps": losses_equal,
                    "losses_rank0": case.losses,
                }
            )
        itemsize = torch.empty(0, dtype=dtype).element_size()
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.orig_argv) if hasattr(sys, "orig_argv") else " ".join(sys.argv),
            "backend": world.backend,
            "world_size": n,
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_head": git_head(),
            "sources": sources,
            "sources_changed_during_run": changed,
            "model": {
                "layers": args.layers,
                "width": args.width,
                "parameters": numel,
                "batch_per_rank": args.batch,
            },
            "bucket_numel": args.bucket_numel,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "paper_volume_bytes_per_step": 2 * numel * (n - 1) / n * itemsize,
            "timed_s": timed_s,
            "wall_s": time.perf_counter() - started,
            "results": results,
        }
        print(markdown(report))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            say(f"[bench] wrote {args.json}")
    for det in modes[1:]:
        worlds[det].close()  # the world group is shared: the first close below destroys it
    world.close()


# --------------------------------------------------------------------------- tables
def markdown(report: dict[str, Any]) -> str:
    model = report["model"]
    out = [
        f"ZeRO step time, {report['backend']} N={report['world_size']}, {report['dtype']}, "
        f"MLP {model['layers']} x {model['width']}^2 ({model['parameters'] / 1e6:.2f}M "
        f"parameters), batch {model['batch_per_rank']}/rank, bucket_numel "
        f"{report['bucket_numel']}, {report['threads']} thread(s)/rank, {report['rounds']} "
        f"interleaved rounds after {report['warmup']} warm-up steps. Sources "
        f"{report['sources']}"
        + (" (CHANGED during the run)" if report["sources_changed_during_run"] else "")
        + f", git {report['git_head']}. Wall {report['wall_s']:.0f} s.\n",
        "### Step time (slowest rank; medians over rounds)\n",
        "| stage | reductions | step ms | ratio to stage 0 | forward ms | backward ms "
        "| step() ms | min-max ms | page faults/step | params = stage 0 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        phases = r["median_phase_s"]
        ratio = r["ratio_to_stage0_median"]
        agreement = r["params_vs_stage0"]
        faults = " / ".join(f"{f / 1e3:.1f}k" for f in r["minor_page_faults_per_step_median"])
        if agreement is None:
            same = "-"
        elif agreement["bit_identical"]:
            same = "bit-identical"
        else:
            same = f"no (max abs diff {agreement['max_abs_diff']:.2e})"
        out.append(
            f"| {r['variant']} | {'deterministic' if r['deterministic'] else 'native'} "
            f"| {r['median_step_s'] * 1e3:.0f} | {'-' if ratio is None else f'{ratio:.2f}'} "
            f"| {phases['forward'] * 1e3:.1f} | {phases['backward'] * 1e3:.0f} "
            f"| {phases['step'] * 1e3:.0f} "
            f"| {r['min_step_s'] * 1e3:.0f}-{r['max_step_s'] * 1e3:.0f} "
            f"| {faults} | {same} |"
        )
    out += [
        "\n### memory_report() per rank, MiB, just after backward (after step() in brackets "
        "where it differs)\n",
        "| stage | reductions | parameters | gradients | master weights | optimizer states "
        "| buffers | comm buffers | model states | total |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        before, after = r["memory_mib"]["after_backward"], r["memory_mib"]["after_step"]
        cells = []
        for name in (*MEMORY_FIELDS, "model_states", "total"):
            text = f"{before[name]:.1f}"
            if abs(after[name] - before[name]) > 0.05:
                text += f" ({after[name]:.1f})"
            cells.append(text)
        out.append(
            f"| {r['variant']} | {'deterministic' if r['deterministic'] else 'native'} | "
            + " | ".join(cells)
            + " |"
        )
    paper = report["paper_volume_bytes_per_step"] / MIB
    out += [
        f"\n### Communication per step (comm.stats, ring convention; paper 2Ψ(N-1)/N = "
        f"{paper:.1f} MiB, 3Ψ(N-1)/N at stage 3)\n",
        "| stage | reductions | collective: calls, MiB | total MiB | / paper |",
        "|---|---|---|---:|---:|",
    ]
    for r in report["results"]:
        ops = r["comm_per_step"]
        total = sum(entry["volume_bytes"] for entry in ops.values()) / MIB
        listed = "; ".join(
            f"{op}: {entry['calls']:g}, {entry['volume_bytes'] / MIB:.1f}"
            for op, entry in ops.items()
        )
        out.append(
            f"| {r['variant']} | {'deterministic' if r['deterministic'] else 'native'} "
            f"| {listed} | {total:.1f} | {total / (paper * (1.5 if r['stage'] == 3 else 1)):.3f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--deterministic",
        choices=("true", "false", "both"),
        default="true",
        help="the communicator's mode; 'both' builds every stage twice and interleaves all",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["0", "1", "2", "3"],
        choices=["0", "1", "2", "3", "3-noprefetch"],
        help="engines to compare; 3-noprefetch is stage 3 with prefetch_numel=0",
    )
    parser.add_argument("--prefetch-numel", type=int, default=zero_core.ZeroConfig().prefetch_numel)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank")
    parser.add_argument("--bucket-numel", type=int, default=zero_core.ZeroConfig().bucket_numel)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per engine")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="where rank 0 writes the results")
    run_rank(parser.parse_args())


if __name__ == "__main__":
    main()
