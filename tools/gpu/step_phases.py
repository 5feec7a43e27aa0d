#!/usr/bin/env python
"""Where one step's time goes on one GPU: forward, backward and step per ZeRO stage, and the
top operators of one profiled step (device time and host time) with the host's
synchronisations counted.

    python -m tools.gpu.step_phases --preset gpt2-medium --stages 0 1 2 3 --batch 8

Each phase ends in torch.cuda.synchronize(), so a phase's time is its own (the sum is a
little above an unsynchronised step's). Medians over ``--steps`` steps after ``--warmup``.
``--allow-cpu`` runs it on gloo/CPU (to test the script).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
from dataclasses import replace

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from tools.gpu.mfu import device_values, random_batch
from zero_models.gpt import GPT, PRESETS, GPTConfig

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_stage(
    stage: int,
    comm: zero_comm.Communicator,
    config: GPTConfig,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    args: argparse.Namespace,
) -> None:
    """Print stage ``stage``'s phase medians and its profiles (module docstring)."""
    device = comm.device
    with torch.device("meta"):
        model = GPT(config)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        zero_core.ZeroConfig(stage=stage, param_dtype=torch.bfloat16),
        comm,
        init_values=device_values(model, device, seed=0),
    )
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}

    def step(record: bool) -> None:
        started = time.perf_counter()
        logits = engine(inputs)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        sync(device)
        forward = time.perf_counter()
        engine.backward(loss)
        sync(device)
        backward = time.perf_counter()
        engine.step()
        sync(device)
        if record:
            times["forward"].append(forward - started)
            times["backward"].append(backward - forward)
            times["step"].append(time.perf_counter() - backward)

    for i in range(args.warmup + args.steps):
        step(i >= args.warmup)
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"stage {stage}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in medians.items())
          + f", total {sum(medians.values()):.1f} ms", flush=True)  # fmt: skip
    if args.pyprofile:  # host time of one step() by Python function, GPU waits included
        logits = engine(inputs)
        engine.backward(F.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                        targets.reshape(-1)))  # fmt: skip
        sync(device)
        profile = cProfile.Profile()
        profile.enable()
        engine.step()
        sync(device)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top * 2)
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(False)
    events = prof.key_averages()
    syncs = {e.key: e.count for e in events if e.key in SYNCS}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    print(f"  host syncs {syncs}, kernel launches {launches}")
    by_device = sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)
    if device.type == "cuda":
        print("  device: " + "; ".join(
            f"{e.key[:60]} x{e.count} {e.self_device_time_total / 1e3:.1f} ms"
            for e in by_device[: args.top]))  # fmt: skip
    print("  host: " + "; ".join(
        f"{e.key[:60]} x{e.count} {e.self_cpu_time_total / 1e3:.1f} ms"
        for e in by_host[: args.top]), flush=True)  # fmt: skip
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--pyprofile", action="store_true", help="cProfile of one engine.step()")
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu_step_phases: no CUDA device (--allow-cpu tries it on the CPU)")
    comm = zero_comm.init("nccl" if torch.cuda.is_available() else "gloo")
    device = comm.device
    config = PRESETS[args.preset]
    if args.layers:
        config = replace(config, layers=args.layers)
    inputs, targets = random_batch(config, args.batch, device)
    for stage in args.stages:
        profile_stage(stage, comm, config, inputs, targets, args)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    comm.close()


if __name__ == "__main__":
    main()
