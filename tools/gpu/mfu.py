"""The MFU section of tools/gpu/check.py: GPT-2 small and XL in bfloat16, our stages 0-3 beside
FSDP2, on one GPU, with the micro-batch each model fits and the goal line of issue 17.

What is compared (``mfu_plan``): per model, the same micro-batch for every run, the largest
of ``BATCH_CANDIDATES`` whose predicted peak at stage 0 (the stage that holds the most) fits
``FIT_FRACTION`` of the device; where stage 0 fits no candidate it is listed as skipped with
that prediction, and the batch is chosen for stage 3. The goal run (stage 3 on GPT-2 XL)
comes first, so that a run cut short by the time budget still measures it.

    FSDP2   torch.distributed.fsdp.fully_shard on each block, then the root, of the same GPT
            built on the meta device; MixedPrecisionPolicy(param_dtype=bf16,
            reduce_dtype=bf16) (ours reduces gradients in the compute dtype too); fp32
            sharded parameters stepped by the same torch AdamW; a mesh of this one GPU.

MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 Psi + 12 L C T (the
PaLM paper's appendix B, as nanoGPT's estimate_mfu: Psi the trainable parameters, the tied
embedding once; 12 L C T the attention scores and their use, T x T counted whole) and the
peak ``--peak-tflops`` (989: H100/H200 SXM dense bfloat16, no sparsity).

Every model is built on the meta device and filled from ``device_values``: the values are
drawn on the GPU, because GPT.initial_values draws 1.6 billion normals on one CPU thread
(about a minute for GPT-2 XL), too slow for one short run; a throughput check needs the same
distributions, not the same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from zero_core import model_state_bytes
from zero_core.estimate.activations import TransformerShape, activation_bytes
from zero_models.gpt import GPT, GPTConfig

MFU_GOAL = 0.40  # issue 17: stage 3, GPT-2 XL, on an H200
GOAL_PRESET = "gpt2-xl"  # at stage 3, ours
BATCH_CANDIDATES = (64, 32, 16, 8, 4, 2, 1)
FIT_FRACTION = 0.85  # of the device's total memory: headroom for allocator slack and
# the loop's float32 copy of the logits, which the estimate does not count
STEP_EXTRA_BYTES_PER_PARAM = 8  # at the step: float32 gradients (4) + AdamW's foreach
# temporaries (up to 4), held while activations are not


def flops_per_token(config: GPTConfig, params: int) -> float:
    """6 Psi + 12 L C T (PaLM, appendix B): forward and backward of every weight, and the
    attention scores and their use."""
    return 6.0 * params + 12.0 * config.layers * config.width * config.context


def device_values(
    model: GPT, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 value on ``device``) per parameter of ``model`` (on meta), drawn from the
    distributions of GPT.initial_values but with a generator on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.layers)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            yield name, torch.zeros(p.shape, device=device)
        elif ".ln_" in name or name.startswith("ln_f"):
            yield name, torch.ones(p.shape, device=device)
        else:
            std = residual_std if name.endswith("proj.weight") else 0.02
            yield name, torch.randn(p.shape, generator=generator, device=device) * std


def predicted_peak(config: GPTConfig, params: int, stage: int, batch: int) -> float:
    """Bytes one GPU holds at the peak of a bf16 step of ours (world size 1): model states
    (zero_core.model_state_bytes) plus the larger of the activations and what the optimizer
    step adds. Activations: zero_core.estimate.activations (bf16), plus the float32 copy of
    the logits that the check's loss makes (n V 4 bytes), which that estimate leaves out."""
    states = model_state_bytes(params, 1, stage).total
    tokens = batch * config.context
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size,
                             tokens)  # fmt: skip
    activations = activation_bytes(shape, dtype_bytes=2).peak + 4.0 * tokens * config.vocab_size
    return states + max(activations, STEP_EXTRA_BYTES_PER_PARAM * params)


class MfuPlan(NamedTuple):
    """The micro-batch of one model, and the stages skipped for memory with the reason."""

    batch: int
    skipped: dict[int, str]


def mfu_plan(config: GPTConfig, params: int, capacity: int | None, fallback: int,
             max_batch: int) -> MfuPlan:  # fmt: skip
    """The largest candidate batch (<= ``max_batch``) whose predicted peak at stage 0 fits
    ``FIT_FRACTION`` of ``capacity`` bytes, else the largest that fits stage 3 (stages below
    it skipped), else none (every stage skipped, FSDP2's row with stage 3's). Without a
    capacity (on CPU): ``fallback``, nothing skipped."""
    if capacity is None:
        return MfuPlan(fallback, {})
    room = FIT_FRACTION * capacity
    candidates = [b for b in BATCH_CANDIDATES if b <= max_batch] or [1]
    smallest = candidates[-1]

    def too_big(stage: int) -> str:
        peak = predicted_peak(config, params, stage, smallest)
        return (f"predicted {peak / 2**30:.1f} GiB at batch {smallest} > {room / 2**30:.1f} "
                f"GiB ({FIT_FRACTION:.0%} of the device)")  # fmt: skip

    for stage in (0, 3):
        fitting = [b for b in candidates if predicted_peak(config, params, stage, b) <= room]
        if fitting:
            return MfuPlan(fitting[0], {s: too_big(s) for s in range(stage)})
    return MfuPlan(smallest, {s: too_big(s) for s in range(4)})


def timed_steps(step: Callable[[], float], device: torch.device, warmup: int,
                steps: int) -> tuple[float, float]:  # fmt: skip
    """(seconds per step, last loss) over ``steps`` steps after ``warmup``."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    loss = float("nan")
    for _ in range(steps):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps, loss


def fsdp2_model(config: GPTConfig, group: Any, device: torch.device, seed: int) -> GPT:
    """The GPT under ``fully_shard`` (each block, then the root), bf16 compute and reduction,
    its fp32 shards filled from ``device_values``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = DeviceMesh.from_group(group, device_type=device.type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = GPT(config, seed=seed)
    values = device_values(model, device, seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values:
            param = params[name]
            shard = distribute_tensor(value, param.device_mesh, param.placements)  # type: ignore[attr-defined]
            param.to_local().copy_(shard.to_local())  # type: ignore[attr-defined]
    return model


def random_batch(
    config: GPTConfig, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of random tokens (seed 0) as (inputs, next-token targets), both
    (batch, context) on ``device``; on CUDA the peak-memory counter starts from here."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.context + 1), generator=generator)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def run_fsdp2(preset: str, config: GPTConfig, batch: int, group: Any, device: torch.device,
              args: Any) -> dict[str, Any]:  # fmt: skip
    """FSDP2 on ``preset`` at ``batch``: the same loop, loss and optimizer as ours."""
    model = fsdp2_model(config, group, device, seed=0)
    if args.compile:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = random_batch(config, batch, device)

    def step() -> float:
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    seconds, loss = timed_steps(step, device, args.warmup, args.steps)
    params = config.num_params
    tokens_per_s = batch * config.context / seconds
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"preset": preset, "peer": "fsdp2", "stage": 3, "parameters": params, "batch": batch,
            "step_s": seconds, "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops_per_token(config, params) / (args.peak_tflops * 1e12),
            "peak_memory_gib": peak / 2**30, "last_loss": loss}  # fmt: skip


def mfu_order(presets: list[str]) -> list[tuple[str, str, int]]:
    """(preset, peer, stage) runs, the goal run first, then FSDP2 beside it, then the rest
    of that model's stages from the most sharded down; the next model likewise."""
    runs = []
    for preset in presets:
        runs += [(preset, "ours", 3), (preset, "fsdp2", 3)]
        runs += [(preset, "ours", s) for s in (2, 1, 0)]
    return runs


def goal_line(rows: list[dict[str, Any]], device_name: str, preset: str = GOAL_PRESET) -> str:
    """Issue 17's goal: MFU >= 40% at stage 3 with GPT-2 XL (``preset``) on an H200: met,
    not met (with the figure), or not measured (and why)."""
    stage = 3
    row = next((r for r in rows if (r.get("preset"), r.get("peer"), r.get("stage"))
                == (preset, "ours", stage)), None)  # fmt: skip
    goal = f"MFU >= {MFU_GOAL:.0%} at stage {stage} with {preset} on an H200"
    if row is None or "mfu" not in row:
        why = (row or {}).get("not_run") or (row or {}).get("error") or "not in --mfu-presets"
        return f"goal ({goal}): not measured: {why}"
    verdict = "met" if row["mfu"] >= MFU_GOAL else "not met"
    on = "" if "H200" in device_name else f" (measured on {device_name}, not an H200)"
    return f"goal ({goal}): {verdict}: {row['mfu']:.1%}{on}"


def mfu_table(rows: list[dict[str, Any]], peak_tflops: float) -> list[str]:
    lines = [f"MFU: tokens/s x (6 Psi + 12 L C T) / {peak_tflops:g} TFLOPS (bf16 dense peak)",
             "", "| model | run | stage | batch | tok/s | MFU | peak GiB | vs FSDP2 tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    fsdp2 = {r["preset"]: r["tokens_per_s"] for r in rows if r.get("peer") == "fsdp2"
             and "tokens_per_s" in r}  # fmt: skip
    for r in rows:
        head = f"| {r['preset']} | {r['peer']} | {r['stage']} |"
        if "tokens_per_s" not in r:
            lines.append(f"{head} | not run: {r.get('not_run') or r.get('error')} | | | |")
            continue
        ratio = (f"{r['tokens_per_s'] / fsdp2[r['preset']]:.2f}x" if r["preset"] in fsdp2
                 else "-")  # fmt: skip
        lines.append(f"{head} {r['batch']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['peak_memory_gib']:.2f} | {ratio} |")  # fmt: skip
    return lines
