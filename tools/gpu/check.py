#!/usr/bin/env python
"""GPU check: GPT presets at ZeRO stages 0-3 on one CUDA GPU (world size 1, nccl).

    python -m tools.gpu.check --json gpu-check.json          (tools/gpu/check.sh)

First MFU (issue 17, tools/gpu/mfu.py): GPT-2 XL and GPT-2 small (``--mfu-presets``) in
bfloat16, our stages 0-3 and FSDP2 beside them, each model at one micro-batch chosen to fit
its stage 0; tokens per second and MFU per run, and the goal line (MFU >= 40% at stage 3
with GPT-2 XL on an H200: met / not met). The goal run goes first.

Then for each of ``--presets`` and stage: build the model on the meta device, train
``--warmup`` + ``--steps`` steps of AdamW in bfloat16 on random tokens, and report tokens
per second, model FLOPs utilisation (6Ψ + 12·layers·width·context FLOPs per token, over
``--peak-tflops``), peak CUDA memory, and the model-state memory zero_core.model_state_bytes
predicts plus the activations zero_core.estimate.activations predicts (its head term counts
bf16 logits and float32 log-probabilities; this loop also makes a float32 copy of the
logits, so expect the peak a little above it). Then M_D: ``--fragmentation-preset`` with
every block checkpointed, with and without the checkpoint arena: reserved minus allocated
and the largest free block (tools/gpu/fragmentation.py). Then offload (ZeRO-Offload):
``--offload-preset`` at stage 3 with master weights, optimizer states and parameter shards
in pinned host memory, its step time against the same run without offload, and against
DeepSpeed's CPU offload (offload_optimizer and offload_param on "cpu") when deepspeed
imports. Runs stop being started once ``--budget-s`` has passed; those not started are
listed as such, never dropped silently. ``--json`` is rewritten after every run, so a
session stopped by its time limit keeps what it measured.

Without a CUDA device it fails (exit 1) with the reason: asked to check a GPU, it must not
pass by skipping; a run that stops with an error (out of memory included) fails it too,
after the others have run. ``--allow-cpu`` runs the same code on gloo/CPU, to test the
script itself (``--mfu-presets test --presets test ...``: see tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
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
from tools.gpu.fragmentation import fragmentation_table, run_fragmentation
from tools.gpu.mfu import (
    GOAL_PRESET,
    device_values,
    flops_per_token,
    goal_line,
    mfu_order,
    mfu_plan,
    mfu_table,
    random_batch,
    run_fsdp2,
    timed_steps,
)
from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_models.gpt import GPT, PRESETS

PRESET_BATCH = {"test": 4, "tiny": 16, "small": 16, "gpt2": 8, "gpt2-medium": 8, "gpt2-xl": 4}


def run_one(
    preset: str, stage: int, comm: zero_comm.Communicator, args: argparse.Namespace,
    offload: str = "none", batch: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    config = PRESETS[preset]
    device = comm.device
    with torch.device("meta"):  # every stage: values drawn on the device (tools.gpu.mfu)
        model = GPT(config)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        zero_core.ZeroConfig(
            stage=stage,
            param_dtype=torch.bfloat16,
            offload_optimizer=offload,
            offload_params=offload if stage == 3 else "none",
        ),
        comm,
        init_values=device_values(model, device, seed=0),
    )
    if args.compile:  # each block's forward only: the engine's hooks stay outside
        for block in model.blocks:  # the engine trains ``model`` in place
            block.forward = torch.compile(block.forward)
    batch = batch or PRESET_BATCH.get(preset, 4)
    inputs, targets = random_batch(config, batch, device)

    def step() -> float:
        logits = engine(inputs)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    seconds, loss = timed_steps(step, device, args.warmup, args.steps)
    psi = sum(p.numel() for _, p in engine.trainable_parameters())
    tokens_per_s = batch * config.context / seconds
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    estimate = zero_core.model_state_bytes(psi, 1, stage).total
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size,
                             batch * config.context)  # fmt: skip
    activations = activation_bytes(shape, dtype_bytes=2).peak
    host = engine.memory_report().host
    engine.close()
    return {
        "preset": preset,
        "peer": "ours",
        "stage": stage,
        "offload": offload,
        "host_gib": host / 2**30,
        "parameters": psi,
        "batch": batch,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(config, psi) / (args.peak_tflops * 1e12),
        "peak_memory_gib": peak / 2**30,
        "model_states_estimate_gib": estimate / 2**30,
        "step_estimate_gib": (estimate + activations) / 2**30,
        "last_loss": loss,
    }


def run_deepspeed_offload(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed stage 3 with optimizer and parameters offloaded to pinned host memory, the
    same model, batch and loop; {"error": ...} when deepspeed does not import or run."""
    try:
        import deepspeed  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except Exception as exc:  # not installed, or its ops fail to load
        return {"preset": preset, "variant": "deepspeed-3-cpu-offload", "error": repr(exc)[:300]}
    config = PRESETS[preset]
    batch = PRESET_BATCH.get(preset, 4)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
    }
    try:
        model = GPT(config)
        optimizer = deepspeed.ops.adam.DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (batch, config.context + 1),
                               generator=generator).to(engine.device)  # fmt: skip
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        def step() -> None:
            logits = engine(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
            engine.backward(loss)
            engine.step()

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / args.steps
    except Exception as exc:
        return {"preset": preset, "variant": "deepspeed-3-cpu-offload", "error": repr(exc)[:300]}
    return {"preset": preset, "variant": "deepspeed-3-cpu-offload", "step_s": seconds,
            "tokens_per_s": batch * config.context / seconds}  # fmt: skip


def run_offload(
    comm: zero_comm.Communicator, args: argparse.Namespace, rows: list[dict[str, Any]],
    save: Callable[[], None],
) -> None:  # fmt: skip
    """Stage 3 of ``--offload-preset`` without and with host offload, and DeepSpeed's, each
    appended to ``rows`` and saved as it ends (DeepSpeed may JIT-build its CPU Adam first)."""
    for offload in ("none", "cpu"):
        rows.append(run_one(args.offload_preset, 3, comm, args, offload=offload))
        print(json.dumps(rows[-1]), flush=True)
        save()
    rows[1]["step_vs_no_offload"] = rows[1]["step_s"] / rows[0]["step_s"]
    if comm.device.type == "cuda":
        rows.append(run_deepspeed_offload(args.offload_preset, args))
    else:
        rows.append({"variant": "deepspeed-3-cpu-offload", "error": "needs a GPU"})
    print(json.dumps(rows[-1]), flush=True)
    save()


def guarded(head: dict[str, Any], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, or ``head`` with the error that stopped it: one run out of memory (or
    refused by torch.compile) must not cost the rest of a short GPU session."""
    try:
        return run()
    except Exception as exc:
        return {**head, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_mfu(comm: zero_comm.Communicator, args: argparse.Namespace, started: float,
            save: Callable[[], None]) -> list[dict[str, Any]]:  # fmt: skip
    """GPT-2 small and XL (``--mfu-presets``), ours at stages 0-3 and FSDP2, one batch per
    model (tools.gpu.mfu.mfu_plan), the goal run first."""
    device = comm.device
    capacity = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    )
    rows: list[dict[str, Any]] = []
    plans = {}
    for preset in args.mfu_presets:
        config = PRESETS[preset]
        plans[preset] = mfu_plan(config, config.num_params, capacity,
                                 args.mfu_batch or PRESET_BATCH.get(preset, 4),
                                 args.mfu_batch or args.mfu_max_batch)  # fmt: skip
    for preset, peer, stage in mfu_order(args.mfu_presets):
        plan = plans[preset]
        head = {"preset": preset, "peer": peer, "stage": stage, "batch": plan.batch}
        if stage in plan.skipped:  # FSDP2 holds what stage 3 holds: its row goes with it
            rows.append({**head, "not_run": f"memory: {plan.skipped[stage]}"})
        elif time.perf_counter() - started > args.budget_s:
            rows.append({**head, "not_run": "time budget"})
        elif peer == "fsdp2":
            group = comm.group  # type: ignore[attr-defined]
            run = partial(run_fsdp2, preset, PRESETS[preset], plan.batch, group, device, args)
            rows.append(guarded(head, run))
        else:
            rows.append(
                guarded(head, partial(run_one, preset, stage, comm, args, batch=plan.batch))
            )
        print(json.dumps(rows[-1]), flush=True)
        save()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mfu-presets", nargs="*", default=["gpt2-xl", "gpt2"])
    parser.add_argument("--mfu-max-batch", type=int, default=32)
    parser.add_argument("--mfu-batch", type=int, help="one batch for every MFU run (no plan)")
    parser.add_argument("--goal-preset", default=GOAL_PRESET, help="the goal: stage 3 MFU")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every section on the 'test' preset, 1+1 steps: tries the script",
    )
    parser.add_argument("--presets", nargs="*", default=["small", "gpt2-medium"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="no run starts after this; tools/gpu/check.sh stops all at 480 s",
    )
    parser.add_argument("--fragmentation-preset", default="gpt2")
    parser.add_argument("--fragmentation-steps", type=int, default=6)
    parser.add_argument("--offload-preset", default="gpt2-medium")
    parser.add_argument("--json", type=Path, help="rewritten after every run")
    parser.add_argument("--allow-cpu", action="store_true", help="test this script on CPU/gloo")
    args = parser.parse_args()
    if args.tiny:
        args.mfu_presets = args.presets = ["test"]
        args.goal_preset = args.fragmentation_preset = args.offload_preset = "test"
        args.warmup, args.steps, args.fragmentation_steps = 1, 1, 2
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu_check: FAILED: no CUDA device is visible to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda}); this check needs one GPU",
            file=sys.stderr,
        )
        return 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    comm = zero_comm.init("nccl" if torch.cuda.is_available() else "gloo", deterministic=False)
    device_name = (torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda"
                   else "CPU")  # fmt: skip
    started = time.perf_counter()
    report: dict[str, Any] = {"device": str(comm.device), "device_name": device_name,
                              "peak_tflops": args.peak_tflops, "mfu": [], "results": [],
                              "fragmentation": [], "offload": []}  # fmt: skip

    def save() -> None:  # after every run: a session cut short keeps what it measured
        if args.json:
            report["elapsed_s"] = time.perf_counter() - started
            args.json.write_text(json.dumps(report, indent=1))

    report["mfu"] = mfu = run_mfu(comm, args, started, save)
    report["mfu_goal"] = goal_line(mfu, device_name, args.goal_preset)
    results: list[dict[str, Any]] = report["results"]
    for preset in args.presets:
        for stage in args.stages:
            head = {"preset": preset, "peer": "ours", "stage": stage}
            if time.perf_counter() - started > args.budget_s:
                results.append({**head, "not_run": "time budget"})
                continue
            results.append(guarded(head, partial(run_one, preset, stage, comm, args)))
            print(json.dumps(results[-1]), flush=True)
            save()
    fragmentation = report["fragmentation"]
    for contiguous in (False, True):
        if time.perf_counter() - started > args.budget_s:
            break
        batch = PRESET_BATCH.get(args.fragmentation_preset, 4)
        head = {"preset": args.fragmentation_preset, "contiguous": contiguous}
        run = partial(run_fragmentation, comm, args.fragmentation_preset, batch,
                      args.fragmentation_steps, contiguous)  # fmt: skip
        fragmentation.append(guarded(head, run))
        save()
    offload: list[dict[str, Any]] = report["offload"]
    if time.perf_counter() - started <= args.budget_s:
        try:
            run_offload(comm, args, offload, save)
        except Exception as exc:  # the tables above are still worth printing
            offload.append({"variant": "ours, stage 3 offload", "error": f"{type(exc).__name__}: "
                            f"{str(exc)[:300]}"})  # fmt: skip
    save()
    lines = [*mfu_table(mfu, args.peak_tflops), "", report["mfu_goal"], ""]
    lines += ["| preset | stage | params | tok/s | MFU | peak GiB | model states est. GiB "
              "| + activations est. GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        if "tokens_per_s" not in r:
            why = r.get("not_run") or r.get("error")
            lines.append(f"| {r['preset']} | {r['stage']} | not run: {why} | | | | | |")
            continue
        lines.append(
            f"| {r['preset']} | {r['stage']} | {r['parameters'] / 1e6:.1f}M | "
            f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.2f} | "
            f"{r['model_states_estimate_gib']:.2f} | {r['step_estimate_gib']:.2f} |"
        )
    lines += ["", *fragmentation_table(fragmentation)]
    lines += [
        "",
        "| offload (stage 3) | step s | tok/s | peak GiB | host GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in offload:
        if "error" in r:
            lines.append(f"| {r['variant']} | not run: {r['error']} | | | |")
        elif "offload" in r:
            lines.append(f"| ours, offload {r['offload']} | {r['step_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['peak_memory_gib']:.2f} | "
                         f"{r['host_gib']:.2f} |")  # fmt: skip
        else:
            lines.append(f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | | |")
    print("\n".join(lines))
    comm.close()
    ours_offload = [r for r in offload if r.get("variant") != "deepspeed-3-cpu-offload"]
    failed = [r for r in (*mfu, *results, *fragmentation, *ours_offload) if "error" in r]
    if failed:  # a run that broke is a failed check, not a skipped one
        print(f"gpu_check: FAILED: {len(failed)} run(s) stopped with an error (see above)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
