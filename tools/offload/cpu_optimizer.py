#!/usr/bin/env python
"""Time the host optimizer step (ZeRO-Offload steps AdamW on the CPU) against memory bandwidth.

    python -m tools.offload.cpu_optimizer --threads 2 --json /tmp/cpu_opt_2.json
    python -m tools.offload.cpu_optimizer --threads 1 --json /tmp/cpu_opt_1.json
    python -m tools.offload.cpu_optimizer --threads 2 --deepspeed     # needs deepspeed installed

What is measured, at the torch thread count given by ``--threads`` (torch.set_num_threads):

1. Bandwidth: a STREAM triad a = b + s*c over three float32 arrays of ``--triad-numel``
   elements (default 1e8: 3 x 400 MB, far beyond any cache), as
   ``torch.add(b, c, alpha=s, out=a)``. GB/s = 12 bytes per element (2 reads + 1 write of 4
   bytes, the STREAM convention; 1e9 bytes per second). Samples are taken before the step
   timing (``--triad-repeats``), between its rounds (``--triad-per-round``) and after it
   (``--triad-repeats``), so they see the same machine as the steps; the bound uses the
   median of all of them (the JSON keeps each phase). The in-place form b = b + s*c
   (``b.add_(c, alpha=s)``) is timed too: it moves the same counted bytes, but its write
   goes to a line it just read, so the hardware moves no more than is counted, as in
   AdamW's in-place updates; an out-of-place write usually costs a read of the line first
   (write-allocate), which the 12 bytes of the triad do not count.

2. The step: ``--numel`` (default 1e8) float32 parameters with a gradient, stepped by
   torch.optim.AdamW(lr=1e-3, weight_decay=0.01) in these variants:

       for-loop          foreach=False, fused=False (what torch picks for CPU tensors)
       foreach           foreach=True
       fused             fused=True (the CPU kernel exists from torch 2.4)
       tiles/<impl>      the same elements as tiles of ``--tile-numel`` (default 2**22), each
                         tile a parameter (a view of one flat tensor); a step calls
                         optimizer.step() once per tile with only that tile's .grad set
       deepspeed         DeepSpeedCPUAdam(adamw_mode=True), only with ``--deepspeed``

   One gradient tensor (random, read-only for AdamW) is shared by every variant; each
   variant owns its parameters and states. One warm-up step (it also allocates the states),
   then ``--steps`` timed steps per variant, interleaved round by round (the order reversed
   every other round) so slow drift of the machine falls on every variant alike. Reported:
   median, min and max seconds per step. With ``--sequential`` the variants run one after
   the other instead, each freed before the next (less memory, no interleaving).

   The bound: AdamW moves at least 28 bytes per parameter per step (reads param, grad,
   exp_avg, exp_avg_sq: 16 B; writes param, exp_avg, exp_avg_sq: 12 B); the bound time is
   numel * 28 / (triad bandwidth). Each variant's fraction of the bound is bound time /
   measured median (1.0 = moving its bytes at the triad's bandwidth). The triad is a
   ceiling only as far as it reaches the machine's bandwidth: a kernel with more streams
   in flight can go faster (a fraction above 1), most likely where one core cannot keep
   enough misses in flight to saturate memory. The fraction against the in-place triad's
   bandwidth is given as well, and "by round": the median over rounds of (bound at the
   triad measured right after the round) / (the variant's time in that round), which
   follows the machine when its bandwidth drifts (other tenants, steal), and "best": the
   bound at the fastest triad sample over the variant's fastest step.

3. Bitwise check: from identical seeded starting values, ``--check-steps`` (default 3) steps
   with identical seeded gradients (a new one per step) on ``--check-numel`` elements (not a
   multiple of the tile or of any vector width); then every pair of variants is compared
   with torch.equal on the parameters, exp_avg, exp_avg_sq and the step count. The table
   also gives, for the parameters against the first variant (the for-loop by default), the
   largest absolute and relative difference, the norm of the difference over the norm of
   the update (final minus starting values), and how many elements differ.

Background load: the CPU time other processes used during the run (/proc/stat's busy time
minus this process's), iowait and steal are reported; on a shared machine a run with the
other processes keeping a CPU busy is not a clean measurement.

Memory: the interleaved run holds every variant at once: 4 bytes x numel x (3 per variant +
the shared gradient + the starting values) + the triad's 3 arrays, plus the temporaries of
the for-loop and foreach steps: a peak RSS of about 10.3 GB at 1e8 with the six torch
variants (4.3 GB with --sequential).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch

from tools.common.provenance import cpu_model, git_head

LR = 1e-3
WEIGHT_DECAY = 0.01
ADAMW_BYTES_PER_PARAM = 28  # reads param, grad, exp_avg, exp_avg_sq; writes param and states
TRIAD_BYTES_PER_ELEMENT = 12  # reads b and c, writes a
TORCH_IMPLS = ("for-loop", "foreach", "fused")
IMPL_OPTIONS: dict[str, dict[str, bool]] = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}


# ------------------------------------------------------------------ machine
def machine() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_head": git_head(),
    }


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "samples": samples,
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
    }


# ---------------------------------------------------------------- bandwidth
class Triad:
    """STREAM triad a = b + s*c and its in-place form b = b + s*c, in GB/s (12 B/element).

    The arrays live for the whole run, so samples can be taken between the step rounds."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.a = torch.zeros(numel)
        self.b = torch.full((numel,), 1.0)
        self.c = torch.full((numel,), 2.0)
        self.samples: dict[str, dict[str, list[float]]] = {}
        self.sample("warm-up")  # touches every page
        self.samples.clear()

    def sample(self, phase: str) -> None:
        counted = TRIAD_BYTES_PER_ELEMENT * self.numel
        out = self.samples.setdefault(phase, {"triad_gbs": [], "inplace_triad_gbs": []})
        start = time.perf_counter()
        torch.add(self.b, self.c, alpha=3.0, out=self.a)
        out["triad_gbs"].append(counted / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        self.b.add_(self.c, alpha=1e-6)
        out["inplace_triad_gbs"].append(counted / (time.perf_counter() - start) / 1e9)

    def result(self) -> dict[str, Any]:
        pooled = {
            key: summary([x for phase in self.samples.values() for x in phase[key]])
            for key in ("triad_gbs", "inplace_triad_gbs")
        }
        return {
            "numel": self.numel,
            "bytes_per_element": TRIAD_BYTES_PER_ELEMENT,
            **pooled,
            "by_phase": {
                phase: {key: summary(v) for key, v in keys.items()}
                for phase, keys in self.samples.items()
            },
        }


class BackgroundLoad:
    """CPU time the rest of the machine used while this process ran (/proc/stat minus
    this process's own CPU time), to tell a quiet measurement from a disturbed one."""

    FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

    def __init__(self) -> None:
        self.start = self._read()

    def _read(self) -> tuple[dict[str, float], float, float]:
        ticks = os.sysconf("SC_CLK_TCK")
        try:
            first = pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            cpu = {k: int(v) / ticks for k, v in zip(self.FIELDS, first, strict=False)}
        except (OSError, IndexError, ValueError):
            cpu = {}
        own = resource.getrusage(resource.RUSAGE_SELF)
        return cpu, own.ru_utime + own.ru_stime, time.monotonic()

    def result(self) -> dict[str, Any]:
        cpu0, own0, t0 = self.start
        cpu1, own1, t1 = self._read()
        if not cpu0 or not cpu1:
            return {"available": False}
        delta = {k: cpu1[k] - cpu0[k] for k in cpu0}
        busy = sum(v for k, v in delta.items() if k not in ("idle", "iowait"))
        wall = t1 - t0
        others = max(0.0, busy - (own1 - own0))
        return {
            "available": True,
            "wall_seconds": wall,
            "own_cpu_seconds": own1 - own0,
            "other_cpu_seconds": others,
            "other_cpus_busy": others / wall,  # average number of CPUs the rest kept busy
            "iowait_cpu_seconds": delta.get("iowait", 0.0),
            "steal_cpu_seconds": delta.get("steal", 0.0),
        }


# ----------------------------------------------------------------- variants
class Stepper:
    """One implementation over its own copy of the parameters; ``step`` runs one step."""

    def __init__(self, name: str, init: torch.Tensor, tile_numel: int) -> None:
        self.name = name
        self.flat = init.clone()
        impl = name.removeprefix("tiles/")
        self.tiled = name.startswith("tiles/")
        if self.tiled:
            bounds = [
                (a, min(a + tile_numel, init.numel())) for a in range(0, init.numel(), tile_numel)
            ]
        else:
            bounds = [(0, init.numel())]
        self.bounds = bounds
        self.params = [self.flat[a:b] for a, b in bounds]
        self.optimizer: torch.optim.Optimizer
        if impl == "deepspeed":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            # imported only when asked for (deepspeed JIT-builds its cpu_adam op on first use)
            adam = importlib.import_module("deepspeed.ops.adam")
            self.optimizer = adam.DeepSpeedCPUAdam(
                self.params, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True
            )
        else:
            options = IMPL_OPTIONS[impl]
            self.optimizer = torch.optim.AdamW(
                self.params,
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                foreach=options["foreach"],
                fused=options["fused"],
            )

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        if self.tiled:  # one optimizer.step() per tile, only that tile's .grad set
            for p, (a, b) in zip(self.params, self.bounds, strict=True):
                p.grad = grad[a:b]
                self.optimizer.step()
                p.grad = None
        else:
            self.params[0].grad = grad
            self.optimizer.step()
            self.params[0].grad = None

    def result(self) -> dict[str, Any]:
        """Parameters and states, flat (tiles concatenated), and the step count."""
        states = [self.optimizer.state[p] for p in self.params]
        return {
            "param": self.flat.clone(),
            "exp_avg": torch.cat([s["exp_avg"].view(-1) for s in states]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].view(-1) for s in states]),
            "steps": sorted({float(s["step"]) for s in states}),
        }


def variant_names(args: argparse.Namespace) -> list[str]:
    names = [v for v in args.variants.split(",") if v]
    unknown = [n for n in names if n.removeprefix("tiles/") not in TORCH_IMPLS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {TORCH_IMPLS} and tiles/<impl>")
    if args.deepspeed:
        names.append("deepspeed")
    return names


def random_tensor(numel: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).mul_(scale)


# ------------------------------------------------------------------ timing
def time_steps(
    args: argparse.Namespace, names: list[str], triad: Triad
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Seconds per step of each variant, and for each sample the triad GB/s (median of the
    ``--triad-per-round`` samples) measured right after its round."""
    numel = args.numel
    init = random_tensor(numel, args.seed)
    grad = random_tensor(numel, args.seed + 1, scale=1e-2)
    times: dict[str, list[float]] = {n: [] for n in names}
    triad_next: dict[str, list[float]] = {n: [] for n in names}

    def timed(stepper: Stepper, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        stepper.step(grad)
        times[stepper.name].append(time.perf_counter() - start)

    def sample_triad(stepped: list[str]) -> None:
        for _ in range(args.triad_per_round):
            triad.sample("between steps")
        recent = triad.samples["between steps"]["triad_gbs"][-args.triad_per_round :]
        for name in stepped:
            triad_next[name].append(statistics.median(recent))

    if args.sequential:
        for name in names:
            stepper = Stepper(name, init, args.tile_numel)
            stepper.step(grad)  # warm-up: allocates the states
            for _ in range(args.steps):
                timed(stepper, grad)
                sample_triad([name])
            del stepper
            gc.collect()
            print(f"  {name:16s} done", flush=True)
    else:
        steppers = [Stepper(n, init, args.tile_numel) for n in names]
        for stepper in steppers:
            stepper.step(grad)  # warm-up: allocates the states
        for r in range(args.steps):
            for stepper in steppers if r % 2 == 0 else reversed(steppers):
                timed(stepper, grad)
            sample_triad(names)
            print(f"  round {r + 1}/{args.steps} done", flush=True)
        del steppers
    gc.collect()
    return {n: summary(t) for n, t in times.items()}, triad_next


# ---------------------------------------------------------------- bitwise
def bitwise_check(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    numel = args.check_numel
    init = random_tensor(numel, args.seed + 100)
    grads = [random_tensor(numel, args.seed + 101 + k, scale=1e-2) for k in range(args.check_steps)]
    before = [g.clone() for g in grads]
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        stepper = Stepper(name, init, args.tile_numel)
        for g in grads:
            stepper.step(g)
        results[name] = stepper.result()
        del stepper
    grads_untouched = all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))

    def equal(x: str, y: str) -> dict[str, bool]:
        rx, ry = results[x], results[y]
        out = {k: torch.equal(rx[k], ry[k]) for k in ("param", "exp_avg", "exp_avg_sq")}
        out["steps"] = rx["steps"] == ry["steps"]
        out["all"] = all(out.values())
        return out

    reference = results[names[0]]["param"]
    update = reference - init  # what the reference's steps changed
    versus_first: dict[str, dict[str, float]] = {}
    for name in names:
        diff = (results[name]["param"] - reference).abs()
        relative = diff / reference.abs().clamp_min(torch.finfo(torch.float32).tiny)
        versus_first[name] = {
            "max_abs_diff_param": float(diff.max()),
            "max_rel_diff_param": float(relative.max()),
            "diff_norm_over_update_norm": float(diff.norm() / update.norm()),
            "differing_elements_param": int((diff != 0).sum()),
        }
    return {
        "numel": numel,
        "steps": args.check_steps,
        "tile_numel": args.tile_numel,
        "reference": names[0],
        "gradients_untouched": grads_untouched,
        "pairs": {x: {y: equal(x, y) for y in names} for x in names},
        "versus_reference": versus_first,
    }


# ------------------------------------------------------------------ report
def report(result: dict[str, Any]) -> None:
    m = result["machine"]
    bw = result["bandwidth"]
    print(
        f"\n{m['cpu_model']}, {m['logical_cpus']} logical CPUs, torch {m['torch']}, "
        f"{m['torch_threads']} thread(s)"
    )
    for key, label in (("triad_gbs", "triad a = b + s*c"), ("inplace_triad_gbs", "b = b + s*c")):
        s = bw[key]
        print(
            f"{label:20s} {s['median']:6.2f} GB/s (min {s['min']:.2f}, max {s['max']:.2f}; "
            f"{bw['numel']:.0e} x 4 B arrays, 12 B/element)"
        )
    bound = result["bound"]
    print(
        f"\nAdamW, {result['numel']:.0e} params, {ADAMW_BYTES_PER_PARAM} B/param: bound "
        f"{bound['seconds_triad']:.3f} s at the triad, {bound['seconds_inplace']:.3f} s at "
        f"the in-place triad"
    )
    print(
        f"{'variant':16s} {'median s':>9s} {'min':>7s} {'max':>7s} {'GB/s':>6s} "
        f"{'of bound':>8s} {'(in-place)':>10s} {'by round':>8s} {'best':>6s}"
    )
    for name, t in result["step_seconds"].items():
        f = result["fraction_of_bound"][name]
        by_round = result["fraction_of_bound_by_round"][name]["median"]
        print(
            f"{name:16s} {t['median']:9.3f} {t['min']:7.3f} {t['max']:7.3f} "
            f"{result['effective_gbs'][name]:6.2f} {f['triad']:8.1%} {f['inplace_triad']:10.1%} "
            f"{by_round:8.1%} {result['fraction_of_bound_best'][name]:6.1%}"
        )
    check = result.get("bitwise")
    if check is None:
        return
    names = list(check["pairs"])
    print(
        f"\nbitwise after {check['steps']} steps, {check['numel']} params, tiles of "
        f"{check['tile_numel']} (= equal params, exp_avg, exp_avg_sq and step; x differs)"
    )
    width = max(len(n) for n in names) + 1
    print(" " * width + "".join(f"{n:>{width}s}" for n in names))
    for x in names:
        row = "".join(f"{'=' if check['pairs'][x][y]['all'] else 'x':>{width}s}" for y in names)
        print(f"{x:{width}s}{row}")
    print(
        f"\nparams against {check['reference']}: max |diff|, max |diff|/|param|, "
        f"||diff|| / ||update||, differing elements"
    )
    for name, d in check["versus_reference"].items():
        print(
            f"  {name:16s} {d['max_abs_diff_param']:.3e} {d['max_rel_diff_param']:.3e} "
            f"{d['diff_norm_over_update_norm']:.3e} {d['differing_elements_param']}"
        )
    print(f"gradients untouched by the steps: {check['gradients_untouched']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=1e8, help="parameters to step (1e8)")
    parser.add_argument("--tile-numel", type=float, default=2**22, help="tile size (2**22)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures")
    parser.add_argument(
        "--variants",
        default="for-loop,foreach,fused,tiles/for-loop,tiles/foreach,tiles/fused",
        help="comma-separated: for-loop, foreach, fused, tiles/<one of those>",
    )
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeedCPUAdam")
    parser.add_argument("--sequential", action="store_true", help="one variant at a time")
    parser.add_argument("--triad-numel", type=float, default=1e8, help="elements per array")
    parser.add_argument("--triad-repeats", type=int, default=10, help="before and after")
    parser.add_argument("--triad-per-round", type=int, default=2, help="between step rounds")
    parser.add_argument("--check-numel", type=float, default=10_000_003)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--no-check", action="store_true", help="skip the bitwise check")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.numel, args.tile_numel = int(args.numel), int(args.tile_numel)
    args.triad_numel, args.check_numel = int(args.triad_numel), int(args.check_numel)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = variant_names(args)

    started = time.time()
    load = BackgroundLoad()
    print(f"triad over 3 x {args.triad_numel:.0e} float32 ...", flush=True)
    triad = Triad(args.triad_numel)
    for _ in range(args.triad_repeats):
        triad.sample("before")
    print(f"stepping {args.numel:.0e} params: {', '.join(names)} ...", flush=True)
    step_seconds, triad_next = time_steps(args, names, triad)
    for _ in range(args.triad_repeats):
        triad.sample("after")
    bandwidth = triad.result()
    del triad
    gc.collect()
    background = load.result()

    moved = ADAMW_BYTES_PER_PARAM * args.numel
    triad_bps = bandwidth["triad_gbs"]["median"] * 1e9
    inplace_bps = bandwidth["inplace_triad_gbs"]["median"] * 1e9
    bound = {"seconds_triad": moved / triad_bps, "seconds_inplace": moved / inplace_bps}
    result: dict[str, Any] = {
        "tool": "bench_cpu_optimizer",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "argv": sys.argv[1:],
        "numel": args.numel,
        "tile_numel": args.tile_numel,
        "steps": args.steps,
        "interleaved": not args.sequential,
        "optimizer": {"class": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "bytes_per_param": ADAMW_BYTES_PER_PARAM,
        "bandwidth": bandwidth,
        "background_load": background,
        "bound": bound,
        "step_seconds": step_seconds,
        "effective_gbs": {n: moved / t["median"] / 1e9 for n, t in step_seconds.items()},
        "fraction_of_bound": {
            n: {
                "triad": bound["seconds_triad"] / t["median"],
                "inplace_triad": bound["seconds_inplace"] / t["median"],
            }
            for n, t in step_seconds.items()
        },
        # best case: the bound at the fastest triad sample over the fastest step (on a
        # shared machine the extremes are the closest to an undisturbed run)
        "fraction_of_bound_best": {
            n: moved / (bandwidth["triad_gbs"]["max"] * 1e9) / t["min"]
            for n, t in step_seconds.items()
        },
        # per round: (28 B x numel / the triad GB/s right after the round) / that step's time
        "fraction_of_bound_by_round": {
            n: summary(
                [
                    moved / (gbs * 1e9) / t
                    for t, gbs in zip(step_seconds[n]["samples"], triad_next[n], strict=True)
                ]
            )
            for n in names
        },
    }
    if not args.no_check:
        print(f"bitwise check: {args.check_steps} steps on {args.check_numel} params ...")
        result["bitwise"] = bitwise_check(args, names)
    result["peak_rss_gb"] = peak_rss_gb()
    result["wall_seconds"] = time.time() - started
    report(result)
    phases = ", ".join(
        f"{phase} {v['triad_gbs']['median']:.2f}" for phase, v in bandwidth["by_phase"].items()
    )
    print(f"\ntriad medians by phase (GB/s): {phases}")
    if background["available"]:
        b = background
        print(
            f"other processes kept {b['other_cpus_busy']:.2f} CPUs busy on average during "
            f"the timing ({b['other_cpu_seconds']:.1f} CPU-s; iowait "
            f"{b['iowait_cpu_seconds']:.1f} s, steal {b['steal_cpu_seconds']:.1f} s)"
        )
    print(f"peak RSS {result['peak_rss_gb']:.1f} GB")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
