"""zero-train's end-of-run report: memory per rank next to stage 0, the last step's
communication next to the paper's 2Ψ (3Ψ at stage 3), a generated sample, and the loss.

``report`` is collective (every rank gathers memory reports and samples, the sample's
logits gathered over tensor parallelism); only the lead rank prints and writes the plot.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from typing import Any

import torch

import zero_comm
import zero_core
from zero_core.estimate.model_states import state_bytes_per_param

from .run_metrics import read_metrics
from .run_plots import write_run_plots
from .tp_mappings import gather_last_dim
from .train_engine_config import DTYPES
from .train_options import CHECKPOINT


def mib(n: float) -> str:
    """Bytes as MiB, 8 characters wide with 2 decimals (a column of the memory table)."""
    return f"{n / 2**20:8.2f}"


def report(
    args: argparse.Namespace,
    engine: zero_core.ZeroEngine,
    metrics_comm: zero_comm.Communicator,
    tp: zero_comm.Communicator,
    history: list[tuple[int, float]],
    lead: bool,
) -> None:
    """Every rank: gather the memory reports over ``metrics_comm``, read the engine's
    traffic of the last step (before sampling adds any) and sample; ``lead`` only: print
    the report and write OUT/loss.png from OUT/metrics.jsonl (closed by then).
    ``history``: the lead's (step, mean loss) pairs of this run segment."""
    reports = metrics_comm.all_gather_object(engine.memory_report()._asdict())
    moved = engine.comm.stats.total_volume_elements  # the last step's, before sampling
    sample = generate(engine.module, tp, args)  # every rank takes part (TP collectives)
    psi = sum(p.numel() for _, p in engine.trainable_parameters())
    tp_volume = float(tp.stats.total_volume_elements) / max(1, args.steps)
    if not lead:
        return
    print_memory(reports, stage0_model_state_bytes(psi, args.dtype))
    kept = engine.compute_params.backward_head_numel()
    print_communication(args, moved, psi, engine.comm.world_size, kept)
    if args.tp > 1:
        print(f"tensor-parallel layers moved {tp_volume:,.0f} elements per rank per step "
              "(forward and backward all-reduces, loss reductions, sampling)")  # fmt: skip
    print(f"\nsample:\n{sample}\n")
    print_loss_and_plot(args, history)


def stage0_model_state_bytes(psi: int, dtype: str) -> float:
    """The paper's model states of ``psi`` AdamW parameters of ``dtype`` (a DTYPES name)
    on one rank without ZeRO: parameters, gradients and K bytes of state each."""
    width = DTYPES[dtype].itemsize
    k = state_bytes_per_param(width, "adamw")
    return zero_core.model_state_bytes(
        psi, 1, 0, optimizer_state_bytes=k, param_bytes=width, grad_bytes=width
    ).total


def print_memory(reports: list[dict[str, Any]], stage0: float) -> None:
    """The table of each rank's model states (``MemoryReport._asdict()`` per rank) in MiB,
    against ``stage0`` bytes."""
    print("\nmemory per rank, MiB (model states; stage 0 would hold"
          f" {mib(stage0).strip()} MiB of model states)")  # fmt: skip
    tiers = any(r.get("host", 0) or r.get("disk", 0) for r in reports)
    print("rank  parameters gradients    master optimizer  comm bufs  model states / stage 0"
          + ("      host      disk" if tiers else ""))  # fmt: skip
    for rank, r in enumerate(reports):
        states = r["parameters"] + r["gradients"] + r["master_weights"] + r["optimizer_states"]
        line = (f"{rank:4d} {mib(r['parameters'])} {mib(r['gradients'])} "
                f"{mib(r['master_weights'])} {mib(r['optimizer_states'])} "
                f"{mib(r['comm_buffers'])}   {mib(states)} / {mib(stage0)}  "
                f"({states / stage0:.2f}x)")  # fmt: skip
        if tiers:
            line += f" {mib(r.get('host', 0))} {mib(r.get('disk', 0))}"
        print(line)
    if tiers:
        print(
            "(host and disk: offloaded model states and their staging buffers, outside "
            "the device's columns; on a CPU-only machine host memory is the device's own)"
        )


def print_communication(
    args: argparse.Namespace, moved: Fraction, psi: int, n: int, kept: int = 0
) -> None:
    """The last step's elements per rank (``moved``) next to the paper's volume for ``psi``
    parameters on ``n`` data-parallel ranks, with why the two differ (``kept``: stage 3's
    elements held gathered from forward to backward, gathered once a step, not twice)."""
    factor = 3 if args.stage == 3 else 2
    paper = Fraction(factor * (n - 1) * psi, n)
    line = (
        f"\ncommunication in the last step: {float(moved):,.0f} elements per rank; the paper's "
        f"{factor}Ψ(N-1)/N = {float(paper):,.0f} (Ψ = {psi:,})"
    )
    if kept:
        # Those padded buckets are gathered in forward only: (N-1)/N of them fewer per rank.
        paper -= Fraction(kept * (n - 1), n)
        line += (
            f", less (N-1)/N of the {kept:,} elements kept gathered from forward for "
            f"backward's start (gathered once, not twice): {float(paper):,.0f}"
        )
    ratio = float(moved / paper) if paper else 0.0
    why = "bucket padding"
    if args.stage == 3:
        why += "; parameters kept whole (persistence threshold) move 2Ψ, not 3Ψ"
    print(f"{line}; ratio {ratio:.3f} ({why})")


def print_loss_and_plot(args: argparse.Namespace, history: list[tuple[int, float]]) -> None:
    """This segment's first and last loss, then OUT/loss.png of the whole run (earlier
    segments of a resumed one included), or why there is no plot."""
    if history:
        (first, start), (last, end) = history[0], history[-1]
        print(f"loss: {start:.3f} at step {first + 1} -> {end:.3f} at step {last + 1}")
    why_not = write_run_plots(args.out / "loss.png", read_metrics(args.out / "metrics.jsonl")[1])
    if why_not is None:
        print(f"wrote {args.out / 'metrics.jsonl'} and {args.out / 'loss.png'}")
    else:
        print(f"wrote {args.out / 'metrics.jsonl'}; {why_not}")
    if args.final_save:
        saved = args.out / CHECKPOINT
        print(f"saved {saved} (zero-consolidate {saved} model.safetensors: the whole model)")
    if args.tensorboard is not None:
        print(f"wrote TensorBoard events to {args.tensorboard} (tensorboard --logdir "
              f"{args.tensorboard})")  # fmt: skip


@torch.no_grad()
def generate(model: torch.nn.Module, tp: zero_comm.Communicator, args: argparse.Namespace) -> str:
    """``args.sample_tokens`` bytes sampled after "def " (temperature 0.8) with the same
    generator on every rank, logits gathered over ``tp``; collective over ``tp``. The model
    is left in training mode."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    device = next(model.parameters()).device
    tokens = torch.tensor([list(b"def ")], dtype=torch.int64, device=device)
    context = int(model.wpe.num_embeddings)  # type: ignore[union-attr, arg-type]
    for _ in range(args.sample_tokens):
        logits = model(tokens[:, -context:])[:, -1, :].float()  # (1, V / tp)
        logits = gather_last_dim(logits.contiguous(), tp) if tp.world_size > 1 else logits
        probs = torch.softmax(logits / 0.8, dim=-1)
        choice = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
        tokens = torch.cat([tokens, choice], dim=1)
    model.train()
    return bytes(int(t) % 256 for t in tokens[0].tolist()).decode("utf-8", errors="replace")
