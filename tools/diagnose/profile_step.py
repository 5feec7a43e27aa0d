#!/usr/bin/env python
"""One training step, phase by phase, for ZeRO stages 0-3 (and DDP beside), timed on rank 0.

    OMP_NUM_THREADS=1 zero-launch -n 2 python -m tools.diagnose.profile_step --size 20m --batch 2 \\
        --stages 0 1 2 3 --ddp --markdown step.md [--json step.json] [--trace DIR]

Every variant is built once, then trained step by step in interleaved rounds (stage 0,
stage 1, ..., DDP, stage 0, ...), so the noise of a shared machine falls on all alike.
Each phase is wall-clock time on rank 0, the median over ``--steps`` steps after
``--warmup``; the last column is each variant's step time over DDP's (stage 0's without
``--ddp``) taken round by round, so that a slow spell of the machine divides out. Phases:

    forward    engine(inputs) and the loss
    backward   engine.backward(loss): autograd, then the gradient collectives
    step       engine.step(): gradient checks, then
                 optimizer   each optimizer.step() over the float32 master tiles
                 publish     what follows the last of them: all-gather of the updated
                             parameters (stages 1-2), stage 3's persistent refresh
    wait       of each phase, the time in the waits of collectives (issued but not
               finished: the ``zero::<collective>.wait`` ranges); the rest of the phase
               is computing or issuing
    CPU        the step's CPU time on rank 0 (user + system): of the whole process (every
               thread: gloo's and torch's too), and of the main thread alone. With as many
               ranks as cores, a step cannot take less wall time than its CPU time, so what
               the other threads add (collectives, their copies) is time the step pays

The wait, optimizer and publish columns come from the engine's ``zero::`` ranges
(zero_comm.profiler_ranges): every measured step runs under torch.profiler (CPU activity,
on every variant alike, DDP too), and the step's ranges on rank 0's main thread give

    wait        the union of the ``zero::<collective>.wait`` ranges within the phase
    optimizer   the sum of the ``zero::optimizer_step`` ranges (each optimizer.step())
    publish     the end of the step phase's last ``zero::optimizer_step`` to the end of
                the step: the updated parameters' last all-gathers and the wait for all
                of them (stages 1-2), stage 3's persistent refresh, the step's counters

Code that emits no ``zero::`` range (the code before issue 45, see docs/step-profile.md)
reads "-" in those columns. DDP (torch's, gloo, ``gradient_as_bucket_view=True``) waits
inside autograd, where no range of ours is: its wait columns read "-". The profiler costs
every operator a few microseconds (an aten::add of 16 elements: 4.6 us, 8.6 us under it,
on the 2-core AMD EPYC VM), every variant alike: totals measured before issue 45, without
it, are a little lower.

``--trace DIR`` runs one more step of each variant under torch.profiler on every rank (all
threads: the swap pipeline's I/O threads too) and writes each rank's Chrome trace
(``DIR/<variant>.json`` rank 0's, ``DIR/<variant>.rank<r>.json`` the others': open them in
https://ui.perfetto.dev or chrome://tracing, or draw them with tools/diagnose/trace_picture.py) and
rank 0's top operators by self CPU time (gloo's collectives appear as ``gloo:all_reduce``
etc., the engine's phases as ``zero::...``) into the Markdown.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import zero_comm
import zero_core
from zero_models.gpt import GPT, GPTConfig

SIZES = {  # vocabulary 256 (bytes), as tools/peers/bench.py
    "smoke": GPTConfig(vocab_size=256, context=32, layers=2, heads=2, width=32),
    "20m": GPTConfig(vocab_size=256, context=128, layers=6, heads=8, width=512),
    "100m": GPTConfig(vocab_size=256, context=128, layers=8, heads=16, width=1024),
}
PHASES = ("forward", "backward", "step")
COLUMNS = ("forward", "forward_wait", "backward", "backward_wait", "step", "optimizer",
           "publish", "step_wait", "total", "cpu", "cpu_main")  # fmt: skip
RANGED = ("forward_wait", "backward_wait", "step_wait", "optimizer", "publish")
# The wait of a collective (not of a unit's gather, nor of the swap files): what the
# columns called wait count, as Communicator's waits.
COLLECTIVE_WAIT = re.compile(
    r"zero::(all_gather|reduce_scatter|all_reduce|all_to_all|broadcast|barrier)\.wait"
)
OPTIMIZER_STEP = "zero::optimizer_step"


class Span(NamedTuple):
    """One recorded range: its name, the thread that ran it, start and end (microseconds)."""

    name: str
    thread: int
    start: float
    end: float


class PhaseClock:
    """Seconds per named phase of the current step, each phase also a ``phase: <name>``
    range on the profiler's timeline (what the ``zero::`` ranges are attributed by)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with record_function(f"phase: {name}"):
                yield
        finally:
            self.seconds[name] += time.perf_counter() - started


def spans_of(prof: profile) -> list[Span]:
    """The phases and the ``zero::`` ranges a profiler recorded."""
    return [Span(e.name, e.thread, e.time_range.start, e.time_range.end)
            for e in prof.events()  # type: ignore[no-untyped-call]
            if e.name.startswith(("phase: ", "zero::"))]  # fmt: skip


def merged_microseconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (nested or overlapping ones count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def ranged_columns(spans: list[Span]) -> dict[str, float] | None:
    """Seconds of the wait, optimizer and publish columns of one step, from its
    ``phase: ...`` and ``zero::`` spans (module docstring); only the ranges of the thread
    that ran the phases count (not the swap pipeline's). None when the code emits no
    ``zero::`` range."""
    phases = {s.name.removeprefix("phase: "): s for s in spans if s.name.startswith("phase: ")}
    if not phases or not any(s.name.startswith("zero::") for s in spans):
        return None
    main = next(iter(phases.values())).thread
    own = [s for s in spans if s.thread == main and s.name.startswith("zero::")]
    out: dict[str, float] = {}
    for name, phase in phases.items():
        waits = [(max(s.start, phase.start), min(s.end, phase.end)) for s in own
                 if COLLECTIVE_WAIT.fullmatch(s.name) and s.start < phase.end
                 and s.end > phase.start]  # fmt: skip
        out[f"{name}_wait"] = merged_microseconds(waits) / 1e6
    optimizer = [s for s in own if s.name == OPTIMIZER_STEP]
    out["optimizer"] = merged_microseconds([(s.start, s.end) for s in optimizer]) / 1e6
    step = phases.get("step")
    in_step = [s.end for s in optimizer if step is not None and step.start <= s.start < step.end]
    out["publish"] = (step.end - max(in_step)) / 1e6 if step is not None and in_step else 0.0
    return out


class Variant:
    """One engine (ours at a stage, or DDP) with its clock; ``one_step`` trains one step and
    returns the seconds of each column (``None`` for a column it cannot see)."""

    def __init__(self, name: str, config: GPTConfig, comm: zero_comm.Communicator,
                 zero_options: dict[str, Any]) -> None:  # fmt: skip
        self.name, self.comm, self.clock = name, comm, PhaseClock()
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = GPT(config, seed=0)
            self.model = DDP(model, process_group=comm.group, gradient_as_bucket_view=True)  # type: ignore[attr-defined]
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            return
        stage = int(name.split("-")[1])
        init_values = None
        if stage == 3:
            with torch.device("meta"):
                model = GPT(config, seed=0)
            init_values = model.initial_values(0)
        else:
            model = GPT(config, seed=0)
        self.engine = zero_core.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4),
            zero_core.ZeroConfig(stage=stage, **zero_options), comm, init_values=init_values,
        )  # fmt: skip

    def one_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float | None]:
        """One step under torch.profiler: the phases' wall-clock time and CPU time, and
        the columns of its ``zero::`` ranges (None where the code emits none)."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            row = self._timed_step(inputs, targets)
        ranged = ranged_columns(spans_of(prof)) if self.name != "ddp" else None
        for column in RANGED:
            row[column] = None if ranged is None else ranged[column]
        return row

    def _timed_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float | None]:
        clock = self.clock
        clock.seconds.clear()
        started = time.perf_counter()
        cpu_started, main_started = time.process_time(), time.thread_time()
        with clock.phase("forward"):
            model = self.model if self.name == "ddp" else self.engine
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        with clock.phase("backward"):
            if self.name == "ddp":
                loss.backward()  # type: ignore[no-untyped-call]
            else:
                self.engine.backward(loss)
        with clock.phase("step"):
            if self.name == "ddp":
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            elif not self.engine.step():
                raise RuntimeError(f"[rank {self.comm.rank}] {self.name}: step was skipped")
        total = time.perf_counter() - started
        cpu, cpu_main = time.process_time() - cpu_started, time.thread_time() - main_started
        self.last_loss = float(loss.detach())  # after the clock: .item() waits for nothing here
        row: dict[str, float | None] = {"total": total, "cpu": cpu, "cpu_main": cpu_main}
        row.update({phase: clock.seconds[phase] for phase in PHASES})
        return row

    def close(self) -> None:
        if self.name != "ddp":
            self.engine.close()


def summarise(rows: list[dict[str, float | None]]) -> dict[str, Any]:
    """Median milliseconds per column (None where unseen), and the total's spread."""
    out: dict[str, Any] = {}
    for column in COLUMNS:
        values = [r[column] for r in rows]
        seen = [v for v in values if v is not None]
        out[column] = 1e3 * statistics.median(seen) if len(seen) == len(values) else None
    totals = sorted(1e3 * (r["total"] or 0.0) for r in rows)
    out["total_min"], out["total_max"], out["steps"] = totals[0], totals[-1], len(totals)
    return out


def add_ratios(summaries: dict[str, dict[str, Any]], rows: dict[str, list[dict[str, Any]]],
               base: str) -> None:  # fmt: skip
    """Each variant's step time over ``base``'s, round by round (the two ran back to back,
    so a slow spell of the machine divides out): the median and the min-max of the ratios."""
    for name, own in rows.items():
        ratios = sorted(r["total"] / b["total"] for r, b in zip(own, rows[base], strict=True))
        summaries[name]["vs"] = base
        summaries[name]["ratio"] = statistics.median(ratios)
        summaries[name]["ratio_min"], summaries[name]["ratio_max"] = ratios[0], ratios[-1]
        summaries[name]["totals_ms"] = [1e3 * r["total"] for r in own]


def markdown(summaries: dict[str, dict[str, Any]], header: str) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    base = next(iter(summaries.values()))["vs"]
    lines = [header, "",
             "| variant | forward | (wait) | backward | (wait) | step | optimizer | publish "
             f"| (wait) | total | total min-max | / {base}, per round: median (min-max) "
             "| CPU, all threads | CPU, main thread |",
             "|---|" + "---:|" * 13]  # fmt: skip
    for name, s in summaries.items():
        cells = " | ".join(ms(s[c]) for c in COLUMNS[: COLUMNS.index("cpu")])
        ratio = f"{s['ratio']:.2f}x ({s['ratio_min']:.2f}-{s['ratio_max']:.2f})"
        cpu = f"{ms(s['cpu'])} | {ms(s['cpu_main'])}"
        lines.append(
            f"| {name} | {cells} | {s['total_min']:.1f}-{s['total_max']:.1f} | {ratio} | {cpu} |"
        )
    return lines


def trace_step(variant: Variant, inputs: torch.Tensor, targets: torch.Tensor, rank: int,
               folder: Path | None, top: int) -> list[str]:  # fmt: skip
    """One more step under torch.profiler; every rank writes its trace (rank 0's is
    ``<variant>.json``, rank r's ``<variant>.rank<r>.json``), rank 0 returns the top ops."""
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        variant.comm.barrier()  # the ranks' profilers started apart: start the step together
        with record_function(variant.name):
            variant._timed_step(inputs, targets)
    if folder is None:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    suffix = "" if rank == 0 else f".rank{rank}"
    prof.export_chrome_trace(str(folder / f"{variant.name}{suffix}.json"))
    if rank != 0:
        return []
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return [f"#### {variant.name}: top {top} operators by self CPU time", "", "```",
            table.strip(), "```", ""]  # fmt: skip


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` ZeroConfig overrides; values parsed as Python literals (ints, floats,
    True/False/None), anything else kept as text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--config {pair!r}: write key=value, e.g. bucket_numel=4194304")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="20m")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--ddp", action="store_true", help="torch DDP beside ours")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--config", nargs="*", default=[], help="ZeroConfig key=value overrides")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--trace", type=Path, help="torch.profiler: one step per variant")
    p.add_argument("--top", type=int, default=12, help="operators listed per trace")
    args = p.parse_args()
    config = SIZES[args.size]
    world = zero_comm.init("gloo", deterministic=False)
    rank = world.rank
    torch.manual_seed(1000 + rank)
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.context + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    names = [f"ours-{s}" for s in args.stages] + (["ddp"] if args.ddp else [])
    options = parse_options(args.config)
    variants = [Variant(n, config, world.split(color=0), options) for n in names]
    rows: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    for index in range(args.warmup + args.steps):
        for variant in variants:
            row = variant.one_step(inputs, targets)
            if index >= args.warmup:
                rows[variant.name].append(row)
    summaries = {n: summarise(r) for n, r in rows.items()}
    add_ratios(summaries, rows, "ddp" if args.ddp else names[0])
    for variant in variants:  # every variant trains the same model on the same batches
        summaries[variant.name]["last_loss"] = variant.last_loss
    traces: list[str] = []
    if args.trace is not None:
        for variant in variants:
            traces += trace_step(variant, inputs, targets, rank, args.trace, args.top)
    for variant in variants:
        variant.close()
    if rank == 0:
        psi = config.num_params
        header = (f"{args.size} GPT ({psi / 1e6:.1f}M parameters: {config.layers} layers x "
                  f"{config.width}, context {config.context}, vocabulary {config.vocab_size}), "
                  f"{world.world_size} ranks (gloo), batch {args.batch} per rank, fp32 AdamW, "
                  f"{torch.get_num_threads()} thread(s) per rank; milliseconds on rank 0, "
                  f"median of {args.steps} steps after {args.warmup}, variants interleaved; "
                  f"ZeroConfig overrides: {options or 'none'}")  # fmt: skip
        lines = markdown(summaries, header) + (["", *traces] if traces else [])
        print("\n".join(lines), flush=True)
        if args.markdown:
            args.markdown.write_text("\n".join(lines) + "\n")
        if args.json:
            report = {"size": args.size, "world_size": world.world_size, "batch": args.batch,
                      "zero_core": zero_core.__file__, "summaries": summaries}  # fmt: skip
            args.json.write_text(json.dumps(report, indent=1))
    world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
