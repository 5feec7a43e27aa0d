#!/usr/bin/env python
"""GPU check: GPT presets at ZeRO stages 0-3 on one CUDA GPU (world size 1, nccl).

    python tools/gpu_check.py --json gpu-check.json          (tools/gpu_check.sh)

For each preset and stage: build the model (on the meta device at stage 3), train
``--warmup`` + ``--steps`` steps of AdamW in bfloat16 on random tokens, and report tokens
per second, model FLOPs utilisation (6Ψ + 12·layers·width·context FLOPs per token, over
``--peak-tflops``), peak CUDA memory, and the model-state memory zero_core.model_state_bytes
predicts plus the activations zero_core.activation_estimate predicts (its head term counts
bf16 logits and float32 log-probabilities; this loop also makes a float32 copy of the
logits, so expect the peak a little above it). Then M_D: ``--fragmentation-preset`` with
every block checkpointed, with and without the checkpoint arena: reserved minus allocated
and the largest free block (tools/fragmentation_check.py). Then offload (ZeRO-Offload):
``--offload-preset`` at stage 3 with master weights, optimizer states and parameter shards
in pinned host memory, its step time against the same run without offload, and against
DeepSpeed's CPU offload (offload_optimizer and offload_param on "cpu") when deepspeed
imports. Runs stop being started once
``--budget-s`` has passed; those not started are listed as such, never dropped silently.

Without a CUDA device it fails (exit 1) with the reason: asked to check a GPU, it must not
pass by skipping. ``--allow-cpu`` runs the same code on gloo/CPU, to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from fragmentation_check import fragmentation_table, run_fragmentation
from torch.nn import functional as F

import zero_comm
import zero_core
from zero_core.activation_estimate import TransformerShape, activation_bytes
from zero_models.gpt import GPT, PRESETS

PRESET_BATCH = {"test": 4, "tiny": 16, "small": 16, "gpt2": 8, "gpt2-medium": 8, "gpt2-xl": 4}


def run_one(
    preset: str, stage: int, comm: zero_comm.Communicator, args: argparse.Namespace,
    offload: str = "none",
) -> dict[str, Any]:  # fmt: skip
    config = PRESETS[preset]
    device = comm.device
    if stage == 3:
        with torch.device("meta"):
            model = GPT(config)
        init_values = model.initial_values(0)
    else:
        model, init_values = GPT(config).to(device), None
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
        init_values=init_values,
    )
    batch = PRESET_BATCH.get(preset, 4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.context + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> float:
        logits = engine(inputs)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / args.steps
    psi = sum(p.numel() for _, p in engine.trainable_parameters())
    tokens_per_s = batch * config.context / seconds
    flops_per_token = 6 * psi + 12 * config.layers * config.width * config.context
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    estimate = zero_core.model_state_bytes(psi, 1, stage).total
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size,
                             batch * config.context)  # fmt: skip
    activations = activation_bytes(shape, dtype_bytes=2).peak
    host = engine.memory_report().host
    engine.close()
    return {
        "preset": preset,
        "stage": stage,
        "offload": offload,
        "host_gib": host / 2**30,
        "parameters": psi,
        "batch": batch,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / (args.peak_tflops * 1e12),
        "peak_memory_gib": peak / 2**30,
        "model_states_estimate_gib": estimate / 2**30,
        "step_estimate_gib": (estimate + activations) / 2**30,
        "last_loss": loss,
    }


def run_deepspeed_offload(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed stage 3 with optimizer and parameters offloaded to pinned host memory, the
    same model, batch and loop; {"error": ...} when deepspeed does not import or run."""
    try:
        import deepspeed  # type: ignore[import-not-found]
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


def run_offload(comm: zero_comm.Communicator, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Stage 3 of ``--offload-preset`` without and with host offload, and DeepSpeed's."""
    rows = [run_one(args.offload_preset, 3, comm, args, offload=o) for o in ("none", "cpu")]
    rows[1]["step_vs_no_offload"] = rows[1]["step_s"] / rows[0]["step_s"]
    if comm.device.type == "cuda":
        rows.append(run_deepspeed_offload(args.offload_preset, args))
    else:
        rows.append({"variant": "deepspeed-3-cpu-offload", "error": "needs a GPU"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "gpt2", "gpt2-medium", "gpt2-xl"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--fragmentation-preset", default="gpt2")
    parser.add_argument("--fragmentation-steps", type=int, default=6)
    parser.add_argument("--offload-preset", default="gpt2-medium")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--allow-cpu", action="store_true", help="test this script on CPU/gloo")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            f"gpu_check: FAILED: no CUDA device is visible to torch {torch.__version__} "
            f"(CUDA build: {torch.version.cuda}); this check needs one GPU",
            file=sys.stderr,
        )
        return 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    comm = zero_comm.init("nccl" if torch.cuda.is_available() else "gloo", deterministic=False)
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    for preset in args.presets:
        for stage in args.stages:
            if time.perf_counter() - started > args.budget_s:
                results.append({"preset": preset, "stage": stage, "not_run": "time budget"})
                continue
            results.append(run_one(preset, stage, comm, args))
            print(json.dumps(results[-1]), flush=True)
    fragmentation = []
    for contiguous in (False, True):
        if time.perf_counter() - started > args.budget_s:
            break
        batch = PRESET_BATCH.get(args.fragmentation_preset, 4)
        fragmentation.append(run_fragmentation(comm, args.fragmentation_preset, batch,
                                               args.fragmentation_steps, contiguous))  # fmt: skip
    offload: list[dict[str, Any]] = []
    if time.perf_counter() - started <= args.budget_s:
        offload = run_offload(comm, args)
        for row in offload:
            print(json.dumps(row), flush=True)
    lines = ["| preset | stage | params | tok/s | MFU | peak GiB | model states est. GiB "
             "| + activations est. GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        if "not_run" in r:
            lines.append(f"| {r['preset']} | {r['stage']} | not run: {r['not_run']} | | | | | |")
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
    if args.json:
        report = {"device": str(comm.device), "results": results, "fragmentation": fragmentation,
                  "offload": offload}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
