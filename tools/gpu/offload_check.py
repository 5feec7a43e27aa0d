#!/usr/bin/env python
"""ZeRO-Offload on one GPU (issue 48, point 6): a short check, under two minutes on an H100.

    python -m tools.gpu.offload_check --json offload-check.json        (tools/gpu/check.sh)

Four sections, cheapest first, each row saved to ``--json`` as it ends:

1. copies: CopyStream (zero_core.offload.copy_streams) moving ``--copy-mib`` MiB of float32
   down (to_host) and up (to_device, cast to bf16), staged in pinned against pageable host
   memory (``offload_pin_memory`` True/False), GB/s each way.
2. DPU: stage 2 with ``offload_optimizer="cpu"`` on ``--step-preset``, step time with and
   without ``delayed_parameter_update`` (where ZeroConfig has that field; otherwise the row
   says "DPU not available").
3. pinned: the same run with ``offload_pin_memory`` True and False, step time.
4. the largest model: a ladder of GPTs (width 2048, 16 heads, context 512, more layers each
   rung), stage 2 with ``offload_optimizer="cpu"``, then without. Each search starts at the
   largest rung the estimate (zero_core.estimate.model_states) fits on the GPU (without
   offload, at most the largest that trained with it). It climbs while a rung
   trains and steps down when one runs out of memory. A rung is not tried past
   ``--max-params``, when its host states would pass ``--host-fraction`` of host memory, or
   when its try (build and one step) would not end within ``--budget-s`` at the slowest
   pace seen so far. The answer is the largest rung that trained, with the next one's
   outcome beside it (out of memory, or why it was not tried).

Every run steps fused AdamW (the host step at memory bandwidth: docs/offload.md).
Fails (exit 1) without a CUDA device unless ``--allow-cpu`` (then ``--tiny`` runs every
section on tiny models on gloo/CPU in seconds, to test the script: tests/test_gpu_check.py),
and when a run stops with an error that is not running out of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from tools.gpu.mfu import device_values, random_batch, timed_steps
from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_core.estimate.model_states import tiered_state_bytes
from zero_core.offload.copy_streams import CopyStream
from zero_models.gpt import GPT, PRESETS, GPTConfig

LADDER_LAYERS = (4, 8, 16, 24, 32, 48, 64, 80, 96, 128)
LADDER = GPTConfig(vocab_size=50257, context=512, layers=4, heads=16, width=2048)
TINY_LADDER = GPTConfig(context=32, layers=1, heads=2, width=32)
STAGE = 2  # ZeRO-Offload's stage


def dpu_available() -> bool:
    return "delayed_parameter_update" in {f.name for f in dataclasses.fields(zero_core.ZeroConfig)}


def out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ copies
def copy_row(device: torch.device, mib: int, pin: bool, repeats: int) -> dict[str, Any]:
    """GB/s of CopyStream's to_host (float32) and to_device (float32 -> bf16) of ``mib``
    MiB, staging pinned or pageable; on CPU the copies are inline (no staging)."""
    numel = mib * 2**20 // 4
    on_device = torch.randn(numel, device=device)
    host = torch.empty(numel)
    up = torch.empty(numel, dtype=torch.bfloat16, device=device)
    copies = CopyStream(device, pin=pin)
    timings = {}

    def down() -> None:
        copies.to_host(on_device, host).wait_host()

    def upload() -> None:
        copies.to_device(host, up).wait_host()

    for name, move in (("to_host", down), ("to_device", upload)):
        move()  # warm: the staging ring is allocated, pinned, on first use
        started = time.perf_counter()
        for _ in range(repeats):
            move()
        timings[name] = (time.perf_counter() - started) / repeats
    exact = torch.equal(up.cpu(), on_device.cpu().to(torch.bfloat16))
    return {
        "section": "copies",
        "pin": pin,
        "mib": mib,
        "to_host_gb_s": numel * 4 / timings["to_host"] / 1e9,
        "to_device_gb_s": numel * 4 / timings["to_device"] / 1e9,
        "staging_mib": copies.staging_bytes / 2**20,
        "values_equal": exact,
    }


# --------------------------------------------------------------- training
def train(
    config: GPTConfig,
    comm: zero_comm.Communicator,
    batch: int,
    warmup: int,
    steps: int,
    **options: Any,
) -> dict[str, Any]:
    """Stage 2 on ``config`` with ZeroConfig ``options`` and fused AdamW: seconds per
    step, peak device memory, host memory."""
    device = comm.device
    with torch.device("meta"):
        model = GPT(config)
    engine = zero_core.initialize(
        model,
        # fused: the host step at memory bandwidth (docs/offload.md), not torch's for-loop
        torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        zero_core.ZeroConfig(stage=STAGE, param_dtype=torch.bfloat16, **options),
        comm,
        init_values=device_values(model, device, seed=0),
    )
    try:
        inputs, targets = random_batch(config, batch, device)

        def step() -> float:
            logits = engine(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
            engine.backward(loss)
            engine.step()
            return float(loss.detach())

        seconds, loss = timed_steps(step, device, warmup, steps)
        host = engine.memory_report().host
    finally:
        engine.close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "parameters": config.num_params,
        "batch": batch,
        "step_s": seconds,
        "tokens_per_s": batch * config.context / seconds,
        "peak_gib": peak / 2**30,
        "host_gib": host / 2**30,
        "last_loss": loss,
    }


def step_rows(
    comm: zero_comm.Communicator, args: argparse.Namespace, add: Callable[[dict[str, Any]], None]
) -> None:
    """Sections 2 and 3 on ``--step-preset``, offload_optimizer="cpu": the synchronous step
    with pinned staging (the baseline), with DPU, and with pageable host memory."""
    config = PRESETS[args.step_preset]
    runs = [
        {"delayed_parameter_update": False, "offload_pin_memory": True},
        {"delayed_parameter_update": True, "offload_pin_memory": True},
        {"delayed_parameter_update": False, "offload_pin_memory": False},
    ]
    times: dict[tuple[bool, bool], float] = {}
    for options in runs:
        head = {"section": "step", "preset": args.step_preset, **options}
        if options["delayed_parameter_update"] and not dpu_available():
            print("offload_check: DPU not available (ZeroConfig has no delayed_parameter_update)")
            add({**head, "not_run": "DPU not available"})
            continue
        given = {k: v for k, v in options.items() if v or k != "delayed_parameter_update"}
        row = guarded(
            head,
            partial(
                train,
                config,
                comm,
                args.batch,
                args.warmup,
                args.steps,
                offload_optimizer="cpu",
                **given,
            ),
        )
        if "step_s" in row:
            times[(options["delayed_parameter_update"], options["offload_pin_memory"])] = row[
                "step_s"
            ]
        add(row)
    base = times.get((False, True))
    if base:
        summary: dict[str, Any] = {"section": "step-summary", "preset": args.step_preset}
        if (True, True) in times:
            summary["dpu_over_sync"] = times[(True, True)] / base
        if (False, False) in times:
            summary["pageable_over_pinned"] = times[(False, False)] / base
        add(summary)


def guarded(head: dict[str, Any], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return {**head, **run()}
    except Exception as exc:
        if out_of_memory(exc):
            return {**head, "outcome": "out of memory"}
        return {**head, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        release()


# ----------------------------------------------------------------- search
def ladder(args: argparse.Namespace) -> list[GPTConfig]:
    if args.tiny:
        return [TINY_LADDER.with_overrides(layers=n) for n in (1, 2, 3)]
    return [LADDER.with_overrides(layers=n) for n in LADDER_LAYERS]


def predicted_bytes(config: GPTConfig, offload: str, batch: int) -> tuple[float, float]:
    """(device, host) bytes the estimate gives: model states in their tiers plus the
    activations (bf16) and the float32 logits of the loss on the device; on the host, the
    float32 gradients the step takes down beside the offloaded states."""
    states = tiered_state_bytes(
        config.num_params, 1, STAGE, offload_optimizer=offload, grad_bytes=4
    )
    host_gradients = 0 if offload == "none" else 4 * config.num_params
    tokens = batch * config.context
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size, tokens)
    activations = activation_bytes(shape, dtype_bytes=2).peak + tokens * config.vocab_size * 4
    return states.device + activations, states.host_resident + host_gradients


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


PRIOR_SECONDS_PER_PARAMETER = 1e-8  # a try (build + one step) of 1e9 parameters: 10 s


def search(
    comm: zero_comm.Communicator,
    args: argparse.Namespace,
    offload: str,
    deadline: float,
    add: Callable[[dict[str, Any]], None],
    *,
    start: int | None = None,
    below: int | None = None,
    pace: list[float] | None = None,
) -> dict[str, Any]:
    """The largest rung of the ladder that trains with ``offload``; every try is a row.

    Starts at rung ``start`` (default: the largest the estimate fits on the device, at
    most rung ``below``), climbs while a rung trains and steps down when one runs out of
    memory. A rung is not tried past ``--max-params``, past the host memory allowed, or
    when its try would not end before ``deadline`` at the slowest pace seen so far
    (``pace``: seconds per parameter of a try, shared between searches; 10 s per 1e9
    parameters before any).
    """
    rungs = ladder(args)
    device = comm.device
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    host_cap = args.host_fraction * host_memory()
    pace = pace if pace is not None else []

    def refusal(config: GPTConfig) -> str | None:
        if config.num_params > args.max_params:
            return f"past --max-params {args.max_params:.3g}"
        if predicted_bytes(config, offload, args.search_batch)[1] > host_cap:
            return f"host states past {args.host_fraction:.0%} of host memory"
        left = deadline - time.perf_counter()
        needs = max(pace, default=PRIOR_SECONDS_PER_PARAMETER) * config.num_params
        if needs > left:
            return f"time budget (a try needs ~{needs:.0f} s, {max(left, 0):.0f} s left)"
        return None

    if start is None:
        fits = [
            i
            for i, c in enumerate(rungs)
            if capacity == 0 or predicted_bytes(c, offload, args.search_batch)[0] < capacity
        ]
        start = fits[-1] if fits else 0
        if below is not None:
            start = min(start, below)
    position = min(max(start, 0), len(rungs) - 1)
    outcomes: dict[int, str] = {}
    while 0 <= position < len(rungs) and position not in outcomes:
        config = rungs[position]
        why = refusal(config)
        head = {
            "section": "largest",
            "offload": offload,
            "layers": config.layers,
            "parameters": config.num_params,
        }
        if why is not None:
            outcomes[position] = f"not tried: {why}"
            add({**head, "outcome": outcomes[position]})
            if "trains" in outcomes.values():
                break  # climbing: what is above is larger still
            position -= 1
            continue
        began = time.perf_counter()
        row = guarded(
            head,
            partial(train, config, comm, args.search_batch, 0, 1, offload_optimizer=offload),
        )
        pace.append((time.perf_counter() - began) / config.num_params)
        if "error" in row:
            add(row)
            break
        trained = "step_s" in row
        outcomes[position] = "trains" if trained else "out of memory"
        add({**row, "outcome": outcomes[position]})
        position += 1 if trained else -1
    trained_rungs = [i for i, o in outcomes.items() if o == "trains"]
    if not trained_rungs:
        return {
            "section": "largest-summary",
            "offload": offload,
            "largest_parameters": None,
            "largest_rung": None,
            "next": outcomes.get(min(outcomes, default=0), "not tried"),
        }
    best = max(trained_rungs)
    return {
        "section": "largest-summary",
        "offload": offload,
        "largest_parameters": rungs[best].num_params,
        "largest_layers": rungs[best].layers,
        "largest_rung": best,
        "next": outcomes.get(best + 1, "none above" if best + 1 == len(rungs) else "not tried"),
    }


# ------------------------------------------------------------------- main
def count(parameters: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6)):
        if parameters >= scale:
            return f"{parameters / scale:.2f}{unit}"
    return f"{parameters:,}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| section | run | step s | tok/s | peak GiB | host GiB | outcome |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["section"] == "copies":
            lines.append(
                f"| copies | pin={r['pin']} {r['mib']} MiB | | | | | "
                f"down {r['to_host_gb_s']:.1f} GB/s, up {r['to_device_gb_s']:.1f} "
                f"GB/s |"
            )
            continue
        if r["section"] == "step-summary":
            said = ", ".join(
                f"{k} {v:.2f}x"
                for k, v in r.items()
                if k.endswith("over_sync") or k.endswith("over_pinned")
            )
            lines.append(f"| step | step time ratios | | | | | {said} |")
            continue
        if r["section"] == "largest-summary":
            largest = r["largest_parameters"]
            said = "none trains" if largest is None else f"{count(largest)} trains"
            lines.append(
                f"| largest | offload={r['offload']} | | | | | {said}; next: {r['next']} |"
            )
            continue
        run = ", ".join(
            f"{k}={v}"
            for k, v in r.items()
            if k in ("offload", "layers", "delayed_parameter_update", "offload_pin_memory")
        )
        if "step_s" in r:
            lines.append(
                f"| {r['section']} | {run} | {r['step_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | "
                f"{r['host_gib']:.2f} | {r.get('outcome', 'trains')} |"
            )
        else:
            why = r.get("outcome") or r.get("not_run") or r.get("error")
            lines.append(f"| {r['section']} | {run} | | | | | {why} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models, 1+1 steps")
    parser.add_argument("--allow-cpu", action="store_true", help="test this script on CPU/gloo")
    parser.add_argument("--json", type=Path, help="rewritten after every row")
    parser.add_argument("--budget-s", type=float, default=100.0, help="no try ends after")
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--step-preset", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--search-batch", type=int, default=2)
    parser.add_argument("--max-params", type=float, default=6e9)
    parser.add_argument("--host-fraction", type=float, default=0.6)
    args = parser.parse_args()
    if args.tiny:
        args.copy_mib, args.step_preset, args.batch = 1, "test", 2
        args.warmup, args.steps, args.search_batch = 1, 1, 2
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"offload_check: FAILED: no CUDA device is visible to torch {torch.__version__}; "
            "this check needs one GPU (--allow-cpu tries it on a CPU)",
            file=sys.stderr,
        )
        return 1
    started = time.perf_counter()
    deadline = started + args.budget_s
    comm = zero_comm.init("nccl" if torch.cuda.is_available() else "gloo")
    device = comm.device
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "dpu_available": dpu_available(),
        "rows": [],
    }
    rows: list[dict[str, Any]] = report["rows"]

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            report["elapsed_s"] = time.perf_counter() - started
            args.json.write_text(json.dumps(report, indent=1))

    for pin in (True, False):
        add(
            guarded(
                {"section": "copies", "pin": pin},
                partial(copy_row, device, args.copy_mib, pin, repeats=3),
            )
        )
    step_rows(comm, args, add)
    # With offload first (the headline), from the largest rung the device and host allow;
    # then without, from the largest rung the estimate fits, never above offload's.
    pace: list[float] = []
    offloaded = search(comm, args, "cpu", deadline, add, pace=pace)
    add(offloaded)
    plain = search(comm, args, "none", deadline, add, pace=pace, below=offloaded["largest_rung"])
    add(plain)
    comm.close()
    print("\n".join(table(rows)))
    failed = [r for r in rows if "error" in r or r.get("values_equal") is False]
    if failed:
        print(
            f"offload_check: FAILED: {len(failed)} row(s) with an error or wrong copies",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
