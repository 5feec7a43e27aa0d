#!/usr/bin/env python
"""Time zero_comm's collectives: deterministic against native, the consistency check, busbw.

One launch measures one backend at one world size:

    zero-launch -n 4 python -m tools.micro.collectives --json bench/gloo-4.json
    mpiexec -n 4 python -m mpi4py -m tools.micro.collectives --backend mpi --json bench/mpi-4.json

and ``--merge`` prints the tables of several launches side by side (no ranks needed):

    python -m tools.micro.collectives --merge bench/gloo-2.json bench/gloo-4.json ...

What is timed (float32, SUM, ``check_consistency=False`` unless said otherwise):

    all_reduce      native: comm.all_reduce with deterministic=False
                    ordered: comm.all_reduce with deterministic=True
    reduce_scatter  native: comm._reduce_scatter_native (the backend's own primitive; on gloo
                            the public call prefers the ordered algorithm even when not
                            deterministic, so the primitive is called directly)
                    ordered: comm.reduce_scatter with deterministic=True
    all_gather, broadcast (src 0): the public calls
    check cost      all_reduce (native and ordered) with check_consistency True against False

Each repeat starts with a barrier and then makes ``inner`` back-to-back calls (20 below 1e6
elements, 3 at 1e6, 1 at 1e7); every call is one sample: a rank times it from the end of
its previous call (or from leaving the barrier), and the sample is the slowest rank's time.
The median over samples is reported (the mean is in the JSON): on a 2-core machine single
calls have a heavy tail of scheduler delays that a mean of batches picks up. Variants that
are compared are interleaved (alternating order, repeat by repeat) in one loop.
Before timing, a check confirms which primitives each variant calls, and that the ordered
results equal the rank-order sum computed locally, bit for bit.

busbw follows nccl-tests: algbw = bytes / time with bytes = the full buffer (the all_reduce
tensor, the reduce_scatter input, the all_gather output, the broadcast tensor); busbw =
algbw * 2(N-1)/N for all_reduce, * (N-1)/N for reduce_scatter and all_gather, * 1 for
broadcast. GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import zero_comm
from tools.common.provenance import git_head, sources_digest

Variant = tuple[Callable[[], None], Callable[[], None]]  # (untimed prepare, timed call)
Measure = Callable[[dict[str, Any]], "float | None"]

SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
BUSBW_SIZES = (1_000_000, 10_000_000)
CHECK_SIZES = (10_000, 1_000_000)


def repeats_for(numel: int, scale: float) -> int:
    base = 20 if numel <= 100_000 else 15 if numel <= 1_000_000 else 9
    return max(3, round(base * scale))


def inner_for(numel: int) -> int:
    """Back-to-back calls after each barrier; each call is one sample."""
    return max(1, min(20, round(3_000_000 / numel)))


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


# ------------------------------------------------------------------------------ timing
class Bench:
    def __init__(self, comm: Any, scale: float, warmup: int) -> None:
        self.comm = comm
        self.scale = scale
        self.warmup = warmup

    def slowest(self, mine: list[float]) -> list[float]:
        """Per sample, the largest time over ranks."""
        everyone = self.comm.all_gather_object(mine)
        return [max(column) for column in zip(*everyone, strict=True)]

    def interleaved(
        self,
        variants: dict[str, Variant],
        repeats: int,
        inner: int,
    ) -> dict[str, list[float]]:
        """variants: name -> (prepare, call); prepare is not timed. Returns slowest-rank samples."""
        names = list(variants)
        for _ in range(self.warmup):
            for name in names:
                prepare, call = variants[name]
                prepare()
                for _ in range(inner):
                    call()
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(repeats):
            for name in names if i % 2 == 0 else reversed(names):
                prepare, call = variants[name]
                prepare()
                self.comm.barrier()
                last = time.perf_counter()
                for _ in range(inner):
                    call()
                    now = time.perf_counter()
                    samples[name].append(now - last)
                    last = now
        return {name: self.slowest(samples[name]) for name in names}


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(samples),
        "mean_s": statistics.fmean(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": samples,
    }


# ---------------------------------------------------------------------------- the cases
class Buffers:
    """Inputs and outputs for one size, allocated once and touched before timing."""

    def __init__(self, numel: int, rank: int, world_size: int) -> None:
        gen = torch.Generator().manual_seed(1000 + rank)
        self.src = torch.randn(numel, generator=gen)
        self.work = self.src.clone()
        self.rs_out = torch.zeros(numel // world_size)
        self.ag_in = self.src[: numel // world_size].clone()
        self.ag_out = torch.zeros(numel)
        self.bc = self.src.clone()


def set_mode(comm: Any, deterministic: bool, check: bool = False) -> None:
    comm.deterministic = deterministic
    comm.check_consistency = check


def all_reduce_variants(
    comm: Any, b: Buffers, *, checks: tuple[bool, ...] = (False,)
) -> dict[str, Variant]:
    def refill() -> None:
        b.work.copy_(b.src)

    def make(det: bool, check: bool) -> Callable[[], None]:
        def call() -> None:
            set_mode(comm, det, check)
            comm.all_reduce(b.work)

        return call

    variants: dict[str, Variant] = {}
    for check in checks:
        for det, label in ((False, "native"), (True, "ordered")):
            key = label if len(checks) == 1 else f"{label}/check={'on' if check else 'off'}"
            variants[key] = (refill, make(det, check))
    return variants


def reduce_scatter_variants(comm: Any, b: Buffers) -> dict[str, Variant]:

    def nothing() -> None:
        return None

    def native() -> None:
        set_mode(comm, False)
        comm._wait(comm._reduce_scatter_native(b.rs_out, b.src, zero_comm.ReduceOp.SUM), "rs")

    def ordered() -> None:
        set_mode(comm, True)
        comm.reduce_scatter(b.rs_out, b.src)

    return {"native": (nothing, native), "ordered": (nothing, ordered)}


def gather_broadcast_variants(comm: Any, b: Buffers) -> dict[str, Variant]:
    def nothing() -> None:
        return None

    def gather() -> None:
        set_mode(comm, False)
        comm.all_gather(b.ag_out, b.ag_in)

    def bcast() -> None:
        set_mode(comm, False)
        comm.broadcast(b.bc, 0)

    return {"all_gather": (nothing, gather), "broadcast": (nothing, bcast)}


# ----------------------------------------------------------------------- verification
PRIMITIVES = (
    "_all_to_all",
    "_all_gather",
    "_broadcast",
    "_all_reduce_native",
    "_reduce_scatter_native",
)


def verify(comm: Any, numel: int) -> dict[str, Any]:
    """Which primitives each timed variant calls, and whether ordered results are exact."""

    n, rank = comm.world_size, comm.rank
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(7 + r)) for r in range(n)]
    reference = inputs[0].clone()
    for x in inputs[1:]:
        reference.add_(x)  # the rank-order left fold, in float32
    chunk = numel // n
    calls: list[str] = []
    for name in PRIMITIVES:
        original = getattr(comm, name)

        def spy(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append(_name)
            return _original(*args)

        setattr(comm, name, spy)
    report: dict[str, Any] = {"numel": numel}
    try:

        def observe(label: str, run: Callable[[], torch.Tensor], want: torch.Tensor) -> None:
            calls.clear()
            got = run()
            report[label] = {
                "primitives": sorted(set(calls)),
                "bit_exact_vs_rank_order": bool(torch.equal(got, want)),
                "fraction_differing": float((got != want).float().mean()),
            }

        def ar(det: bool) -> torch.Tensor:
            set_mode(comm, det)
            t: torch.Tensor = inputs[rank].clone()
            comm.all_reduce(t)
            return t

        def rs_native() -> torch.Tensor:
            set_mode(comm, False)
            out = torch.empty(chunk)
            comm._wait(comm._reduce_scatter_native(out, inputs[rank], zero_comm.ReduceOp.SUM), "rs")
            return out

        def rs_ordered() -> torch.Tensor:
            set_mode(comm, True)
            out = torch.empty(chunk)
            comm.reduce_scatter(out, inputs[rank])
            return out

        def rs_public_not_det() -> torch.Tensor:
            set_mode(comm, False)
            out = torch.empty(chunk)
            comm.reduce_scatter(out, inputs[rank])
            return out

        mine = reference[rank * chunk : (rank + 1) * chunk]
        observe("all_reduce/native", lambda: ar(False), reference)
        observe("all_reduce/ordered", lambda: ar(True), reference)
        observe("reduce_scatter/native", rs_native, mine)
        observe("reduce_scatter/ordered", rs_ordered, mine)
        observe("reduce_scatter/public deterministic=False", rs_public_not_det, mine)
    finally:
        for name in PRIMITIVES:
            delattr(comm, name)  # back to the class's methods: no spy while timing
    everyone = comm.all_gather_object(report)
    merged: dict[str, Any] = {"numel": numel}
    for label, entry in report.items():
        if label == "numel":
            continue
        merged[label] = {
            "primitives": entry["primitives"],
            "bit_exact_on_all_ranks": all(r[label]["bit_exact_vs_rank_order"] for r in everyone),
            "fraction_differing_max": max(r[label]["fraction_differing"] for r in everyone),
        }
    expected = {
        "all_reduce/native": ["_all_reduce_native"],
        "all_reduce/ordered": ["_all_gather", "_all_to_all"],
        "reduce_scatter/native": ["_reduce_scatter_native"],
        "reduce_scatter/ordered": ["_all_to_all"],
    }
    problems = [
        f"{label} called {merged[label]['primitives']}, expected {want}"
        for label, want in expected.items()
        if merged[label]["primitives"] != want
    ]
    for label in ("all_reduce/ordered", "reduce_scatter/ordered"):
        if not merged[label]["bit_exact_on_all_ranks"]:
            problems.append(f"{label} is not bit-identical to the rank-order sum")
    merged["problems"] = problems
    return merged


# ------------------------------------------------------------------------------- main
def run_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)

    started = time.perf_counter()
    sources = sources_digest(
        zero_comm
    )  # the zero_comm this process imported (editable installs move)
    comm = zero_comm.init(args.backend, deterministic=False)
    n, rank = comm.world_size, comm.rank

    def say(text: str) -> None:
        if rank == 0:
            print(text, file=sys.stderr, flush=True)

    say(f"[bench] {comm!r}, torch {torch.__version__}, threads {torch.get_num_threads()}")

    checked = verify(comm, 100_000)
    say(f"[bench] verification: {json.dumps(checked)}")
    if checked["problems"] and not args.ignore_problems:
        raise SystemExit(f"verification failed: {checked['problems']}")

    bench = Bench(comm, args.scale, args.warmup)
    results: list[dict[str, Any]] = []

    def record(part: str, op: str, variant: str, numel: int, inner: int, s: list[float]) -> None:
        entry = {
            "part": part,
            "op": op,
            "variant": variant,
            "numel": numel,
            "inner": inner,
            "bytes": numel * 4,
            **summary(s),
        }
        results.append(entry)
        say(
            f"[bench] {part:8s} {op:14s} {variant:22s} {numel:>9d}  "
            f"median {entry['median_s'] * 1e3:9.3f} ms  mean {entry['mean_s'] * 1e3:9.3f} ms  "
            f"({len(s)} calls)"
        )

    for numel in args.sizes:
        b = Buffers(numel, rank, n)
        reps, inner = repeats_for(numel, args.scale), inner_for(numel)
        for op, variants in (
            ("all_reduce", all_reduce_variants(comm, b)),
            ("reduce_scatter", reduce_scatter_variants(comm, b)),
        ):
            for variant, s in bench.interleaved(variants, reps, inner).items():
                record("det", op, variant, numel, inner, s)
        if numel in args.check_sizes:
            variants = all_reduce_variants(comm, b, checks=(False, True))
            for variant, s in bench.interleaved(variants, reps, inner).items():
                record("check", "all_reduce", variant, numel, inner, s)
        if numel in args.busbw_sizes:
            for variant, s in bench.interleaved(
                gather_broadcast_variants(comm, b), reps, inner
            ).items():
                record("busbw", variant, "public", numel, inner, s)
        del b

    set_mode(comm, False, True)
    comm.barrier()
    if rank == 0:
        report = {
            "backend": comm.backend,
            "world_size": n,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.orig_argv) if hasattr(sys, "orig_argv") else " ".join(sys.argv),
            "launcher": os.environ.get("ZERO_LAUNCHER")
            or ("mpich" if "PMI_RANK" in os.environ else "?"),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "mpi": _mpi_version() if comm.backend == "mpi" else None,
            "zero_comm_sources": sources,
            "zero_comm_sources_changed_during_run": sources_digest(zero_comm) != sources,
            "git_head": git_head(),
            "wall_s": time.perf_counter() - started,
            "verification": checked,
            "results": results,
        }
        print(markdown([report]))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            say(f"[bench] wrote {args.json}")
    comm.close()


def _mpi_version() -> str:
    from mpi4py import MPI

    return str(MPI.Get_library_version().strip().splitlines()[0])


# --------------------------------------------------------------------------- tables
def _find(report: dict[str, Any], part: str, op: str, variant: str, numel: int) -> Any:
    for r in report["results"]:
        if (r["part"], r["op"], r["variant"], r["numel"]) == (part, op, variant, numel):
            return r
    return None


def _size(numel: int) -> str:
    return f"1e{len(str(numel)) - 1}" if str(numel).strip("0") == "1" else str(numel)


def _spread(values: list[float], fmt: str) -> str:
    """The median of per-launch values, and their range when there are several launches."""
    middle = format(statistics.median(values), fmt)
    if len(values) == 1:
        return middle
    return f"{middle} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def markdown(reports: list[dict[str, Any]]) -> str:
    """Tables with one column per (backend, world size); several launches of one are pooled:
    a cell is the median over launches of each launch's figure, [min-max] over launches."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in reports:
        groups.setdefault((rep["backend"], rep["world_size"]), []).append(rep)
    keys = sorted(groups, key=lambda k: (k[0] != "gloo", k[0], k[1]))
    head = "| " + " | ".join(f"{b} N={n}" for b, n in keys) + " |"
    rule = "|---|---|" + "---:|" * len(keys)
    runs = ", ".join(f"{b} N={n}: {len(groups[(b, n)])}" for b, n in keys)

    def sizes(part: str) -> list[int]:
        return sorted({r["numel"] for rep in reports for r in rep["results"] if r["part"] == part})

    def per_launch(key: tuple[str, int], fn: Measure) -> list[float]:
        values = [fn(rep) for rep in groups[key]]
        return [v for v in values if v is not None]

    def ratio(part: str, op: str, a: str, b: str, numel: int) -> Callable[[Any], float | None]:
        def fn(rep: dict[str, Any]) -> float | None:
            x, y = _find(rep, part, op, a, numel), _find(rep, part, op, b, numel)
            return x["median_s"] / y["median_s"] if x and y else None

        return fn

    def ms(part: str, op: str, variant: str, numel: int) -> Callable[[Any], float | None]:
        def fn(rep: dict[str, Any]) -> float | None:
            x = _find(rep, part, op, variant, numel)
            return x["median_s"] * 1e3 if x else None

        return fn

    def cell(values: list[float], fmt: str) -> str:
        return _spread(values, fmt) if values else "-"

    digests = sorted({str(rep.get("zero_comm_sources")) for rep in reports})
    changed = sum(bool(rep.get("zero_comm_sources_changed_during_run")) for rep in reports)
    out = [
        f"Launches pooled per column: {runs}. zero_comm sources (sha256/12): "
        f"{', '.join(digests)}"
        + (f"; changed during {changed} launch(es)" if changed else "")
        + ".\n"
    ]
    out.append("### Time ordered (deterministic) / native, median per launch\n")
    out.append("| op | elements " + head)
    out.append(rule)
    for op in ("all_reduce", "reduce_scatter"):
        for numel in sizes("det"):
            cells = [
                cell(per_launch(k, ratio("det", op, "ordered", "native", numel)), ".2f")
                for k in keys
            ]
            out.append(f"| {op} | {_size(numel)} | " + " | ".join(cells) + " |")

    out.append("\n### Median time per call, ms (native / ordered)\n")
    out.append("| op | elements " + head)
    out.append(rule)
    for op in ("all_reduce", "reduce_scatter"):
        for numel in sizes("det"):
            cells = []
            for k in keys:
                nat = per_launch(k, ms("det", op, "native", numel))
                det = per_launch(k, ms("det", op, "ordered", numel))
                cells.append(
                    f"{statistics.median(nat):.3g} / {statistics.median(det):.3g}"
                    if nat and det
                    else "-"
                )
            out.append(f"| {op} | {_size(numel)} | " + " | ".join(cells) + " |")

    out.append("\n### Consistency check on all_reduce: time with check / without\n")
    out.append("| algorithm | elements " + head)
    out.append(rule)
    for algo in ("native", "ordered"):
        for numel in sizes("check"):
            cells = []
            for k in keys:
                r = per_launch(
                    k, ratio("check", "all_reduce", f"{algo}/check=on", f"{algo}/check=off", numel)
                )
                on = per_launch(k, ms("check", "all_reduce", f"{algo}/check=on", numel))
                off = per_launch(k, ms("check", "all_reduce", f"{algo}/check=off", numel))
                diffs = [a - b for a, b in zip(on, off, strict=True)]
                added = statistics.median(diffs) * 1e3 if diffs else 0.0
                cells.append(f"{cell(r, '.2f')} ({added:+.0f} µs)" if r else "-")
            out.append(f"| {algo} | {_size(numel)} | " + " | ".join(cells) + " |")

    out.append("\n### Bus bandwidth, GB/s (nccl-tests convention, from the median time)\n")
    out.append("| collective | elements " + head)
    out.append(rule)
    rows = (
        ("all_reduce native", "det", "all_reduce", "native"),
        ("all_reduce ordered", "det", "all_reduce", "ordered"),
        ("reduce_scatter native", "det", "reduce_scatter", "native"),
        ("reduce_scatter ordered", "det", "reduce_scatter", "ordered"),
        ("all_gather", "busbw", "all_gather", "public"),
        ("broadcast", "busbw", "broadcast", "public"),
    )
    for title, part, op, variant in rows:
        for numel in sizes("busbw"):
            cells = []
            for k in keys:

                def busbw(
                    rep: dict[str, Any],
                    op: str = op,
                    variant: str = variant,
                    part: str = part,
                    numel: int = numel,
                ) -> float | None:
                    r = _find(rep, part, op, variant, numel)
                    if r is None:
                        return None
                    algbw = float(r["bytes"]) / float(r["median_s"]) / 1e9
                    return algbw * bus_factor(op, int(rep["world_size"]))

                cells.append(cell(per_launch(k, busbw), ".2f"))
            out.append(f"| {title} | {_size(numel)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo", choices=("gloo", "mpi", "nccl"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--busbw-sizes", type=int, nargs="*", default=list(BUSBW_SIZES))
    parser.add_argument("--check-sizes", type=int, nargs="*", default=list(CHECK_SIZES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the repeat counts")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per case")
    parser.add_argument("--json", help="where rank 0 writes the results")
    parser.add_argument(
        "--ignore-problems",
        action="store_true",
        help="time even if the verification finds a wrong algorithm or result",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="print the tables of earlier runs side by side, and exit",
    )
    args = parser.parse_args()
    if args.merge:
        reports = []
        for path in args.merge:
            with open(path) as f:
                reports.append(json.load(f))
        print(markdown(reports))
        return
    run_rank(args)


if __name__ == "__main__":
    main()
