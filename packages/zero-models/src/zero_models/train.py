"""``zero-train``: train a GPT with ZeRO on the default corpus, or on your data.

    zero-train                              # 2 local ranks, gloo, highest stage, small GPT
    zero-train --nproc 4 --stage 1 --steps 500 --dtype bf16
    zero-train --save-every 100; zero-train --resume runs/zero-train/checkpoint --nproc 4
    mpirun -n 4 zero-train --backend mpi    # any launcher zero_comm.init understands

Run by hand (no launcher variables) it checks the options, then starts ``--nproc`` local
ranks of itself with zero-launch. Each rank trains its part of every global batch; rank 0
shows progress, and at the end prints each rank's memory next to what stage 0 would hold,
the communication per step next to the paper's 2Ψ, and a generated sample. Metrics go to
``OUT/metrics.jsonl`` and the loss curve to ``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F
from tqdm import tqdm

import zero_comm
import zero_core
from zero_comm.launch import launch
from zero_comm.launcher_env import detect_launch_env
from zero_core.memory_estimate import state_bytes_per_param
from zero_core.memory_tracker import process_status_kib

from .checkpoint_plan import checkpoint_gpt_blocks
from .data import BatchSampler, load_tokens
from .gpt import GPT, GPTConfig
from .phase_memory import phase_record, phase_table
from .run_metrics import corpus_digest, open_metrics, read_metrics
from .run_plots import write_run_plots
from .tp_layers import vocab_parallel_cross_entropy
from .tp_mappings import gather_last_dim
from .tp_plan import Mesh, make_mesh, sharded_parameters, tensor_parallel_gpt
from .train_options import (
    CHECKPOINT,
    DTYPES,
    EXIT_FAILED,
    EXIT_PREEMPTED,
    RESULTS,
    earlier_results,
    learning_rate,
    model_config,
    own_schedule,
    parse_options,
    threads_per_rank,
)


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 where there is none)."""
    return (process_status_kib("VmRSS") or 0) / 1024


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


class PreemptionFlag:
    """Set by the first of ``signals`` this rank receives (SLURM's SIGTERM at preemption or
    time limit, a --signal=USR1 warning); the training loop reads it at the end of a step.

    The handler only records the signal: the step in flight finishes, the ranks agree at
    the step's loss all-reduce (any rank's flag stops all), save, and exit."""

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.received: signal.Signals | None = None
        for signum in signals:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


def clear_earlier_results(out: Path) -> None:
    """--overwrite: remove what another run left in ``out`` (its checkpoint too, so that a
    later --resume auto cannot pick up that run's state)."""
    for name in RESULTS:
        for path in (out / name, out / f"{name}.old", out / f"{name}.saving"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


class Run(NamedTuple):
    """What one rank trains with: its communicators, the model behind the engine, data."""

    world: zero_comm.Communicator
    metrics_comm: zero_comm.Communicator  # logging traffic, kept out of the engine's stats
    mesh: Mesh
    config: GPTConfig
    tokens: torch.Tensor
    engine: zero_core.ZeroEngine
    sampler: BatchSampler
    tracker: zero_core.MemoryTracker
    checkpointing: Any

    def close(self) -> None:
        for comm in (self.metrics_comm, self.mesh.tp, self.mesh.dp):
            comm.close()
        self.world.close()


def build_run(args: argparse.Namespace) -> Run:
    """Communicators, the GPT (on meta at stage 3 without TP: no rank holds it whole), the
    engine and the data sampler of this rank."""
    world = zero_comm.init(args.backend, deterministic=True)
    metrics_comm = world.split(color=0)
    mesh = make_mesh(world, args.tp)
    config = model_config(args)
    tokens = load_tokens(args.data)
    if args.data is None or tokens.max() < 256:
        config = config.with_overrides(vocab_size=max(config.vocab_size, 256))
    init_values = None
    if args.stage == 3 and args.tp == 1:
        with torch.device("meta"):
            model = GPT(config, seed=args.seed)
        init_values = model.initial_values(args.seed)
    else:
        model = GPT(config, seed=args.seed).to(world.device)  # built whole, then placed
    model_parallel = None
    if args.tp > 1:
        tensor_parallel_gpt(model, mesh.tp)
        model_parallel = zero_core.ModelParallel.of(mesh.tp, sharded_parameters(model))
    checkpointing = checkpoint_gpt_blocks(
        model, args.checkpoint, mesh.tp, offload=args.offload_checkpoints
    )
    setup = getattr(args, "deepspeed_setup", None)
    own_optimizer = setup is None or setup.optimizer is None
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
        if own_optimizer
        else None,
        setup
        or zero_core.ZeroConfig(
            stage=args.stage,
            param_dtype=DTYPES[args.dtype],
            gradient_accumulation_steps=args.grad_accum,
            clip_grad_norm=args.clip or None,
        ),
        mesh.dp,
        model_parallel=model_parallel,
        init_values=init_values,
    )
    sampler = BatchSampler(
        tokens, context=config.context, global_batch=args.batch_size,
        dp_rank=mesh.dp.rank, dp_size=mesh.dp.world_size, seed=args.seed,
    )  # fmt: skip
    tracker = zero_core.MemoryTracker(world.device)
    return Run(world, metrics_comm, mesh, config, tokens, engine, sampler, tracker, checkpointing)


def announce(args: argparse.Namespace, run: Run, first_step: int, threads: str) -> None:
    """Rank 0: clear an --overwrite'd folder, then say what is about to train."""
    found = earlier_results(args.out)
    if args.overwrite and args.resume is None and found:
        clear_earlier_results(args.out)
        print(f"zero-train: --overwrite: removed the earlier run's {', '.join(found)} "
              f"from {args.out}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume is not None:
        print(f"zero-train: resumed from {args.resume} at step {first_step}", flush=True)
    config, dp = run.config, run.mesh.dp
    print(
        f"zero-train: GPT {config.layers}x{config.width} ({config.num_params / 1e6:.2f}M "
        f"parameters), stage {args.stage}, {run.world.world_size} ranks ({args.tp} "
        f"tensor-parallel x {dp.world_size} data-parallel) on {dp.backend}, {args.dtype}, "
        f"{run.tokens.numel():,} tokens of data, {threads}",
        flush=True,
    )


def current_lr(engine: zero_core.ZeroEngine) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])


def train_step(args: argparse.Namespace, run: Run, step: int) -> float:
    """One optimizer step (--grad-accum micro-batches); this rank's mean loss."""
    engine, tracker = run.engine, run.tracker
    if own_schedule(args):
        for group in engine.optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
    total = 0.0
    for micro in range(args.grad_accum):
        inputs, targets = (t.to(run.world.device) for t in run.sampler.batch(step, micro))
        with tracker.phase("forward"):
            logits = engine(inputs)
            if args.tp > 1:
                loss = vocab_parallel_cross_entropy(logits, targets, run.mesh.tp)
            else:
                loss = F.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)
                )
            del logits  # the loss's graph keeps what backward needs
        with tracker.phase("backward"):
            engine.backward(loss)
        total += loss.item() / args.grad_accum
        del loss
        with tracker.phase("step"):
            engine.step()
    return total


def save_or_exit(args: argparse.Namespace, run: Run, step: int) -> None:
    """Save OUT/checkpoint after ``step``; a failed save (every rank has the same error)
    ends the run with one line from rank 0 and exit code 1."""
    # The step to start from, and the seed: the data order and the learning rate are
    # functions of those, so a resumed run continues bit for bit.
    try:
        run.engine.save(args.out / CHECKPOINT, extra={"step": step + 1, "seed": args.seed})
    except zero_core.CheckpointError as exc:
        if run.world.rank == 0:
            print(f"zero-train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)


def train(args: argparse.Namespace) -> None:
    preemption = PreemptionFlag(args.preempt_signals)
    threads, threads_from = threads_per_rank(args.threads, detect_launch_env().local_world_size)
    torch.set_num_threads(threads)
    run = build_run(args)
    engine, metrics_comm = run.engine, run.metrics_comm
    lead = run.world.rank == 0
    first_step = 0 if args.resume is None else int(engine.load(args.resume).get("step", 0))
    metrics = None
    if lead:
        plural = "s" if threads > 1 else ""
        announce(args, run, first_step, f"{threads} thread{plural} per rank ({threads_from})")
        run_record = {"fingerprint": engine.fingerprint().to_json(),
                      "corpus": corpus_digest(run.tokens), "first_step": first_step,
                      "argv": sys.argv[1:]}  # fmt: skip
        metrics = open_metrics(args.out / "metrics.jsonl", run_record, append=first_step > 0)
    history: list[tuple[int, float]] = []
    start = time.perf_counter()
    tokens_per_step = args.batch_size * args.grad_accum * run.config.context
    end_step = args.steps if args.stop_after is None else args.stop_after
    stopping = False
    # A progress bar on a terminal; plain lines (every 5% of the run) in a log file.
    progress = (
        tqdm(total=end_step, initial=first_step, desc="zero-train", unit="step", file=sys.stdout)
        if lead and sys.stdout.isatty()
        else None
    )
    for step in range(first_step, end_step):
        step_start = time.perf_counter()
        if step == end_step - 1:
            engine.comm.stats.reset()  # the last step's traffic is what gets reported
        step_lr = learning_rate(step, args) if own_schedule(args) else current_lr(engine)
        total = train_step(args, run, step)
        # The mean loss, and whether any rank was asked to stop (its flag averages above 0).
        mean = torch.tensor([total, float(preemption.received is not None)])
        metrics_comm.all_reduce(mean, zero_comm.ReduceOp.AVG)
        stopping = bool(mean[1] > 0)
        # Every rank's resident memory and step time, for the soak report (tools/soak.py).
        mine = torch.tensor([resident_mib(), time.perf_counter() - step_start], dtype=torch.float64)
        per_rank = torch.empty(2 * metrics_comm.world_size, dtype=torch.float64)
        metrics_comm.all_gather(per_rank, mine)
        if stopping or (
            args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == end_step)
        ):
            save_or_exit(args, run, step)
        if metrics is None:
            if stopping:
                break
            continue
        elapsed = time.perf_counter() - start
        rate = tokens_per_step * (step + 1 - first_step) / elapsed
        loss = mean[0].item()
        history.append((step, loss))
        table = per_rank.view(-1, 2)
        record = {"step": step, "loss": loss, "lr": step_lr,
                  "tokens_per_s": round(rate, 1), "elapsed_s": round(elapsed, 2),
                  "step_s": round(float(table[:, 1].max()), 5),
                  "rss_mib": [round(float(v), 2) for v in table[:, 0]]}  # fmt: skip
        metrics.write(json.dumps(record) + "\n")
        memory = engine.memory_report().total / 2**20
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(
                f"loss {loss:.4f}, {rate:.0f} tok/s, mem {memory:.1f} MiB", refresh=False
            )
        elif step % max(1, args.steps // 20) == 0 or step == end_step - 1 or stopping:
            print(f"step {step + 1:5d}/{args.steps}  loss {loss:.4f}  {rate:8.0f} tok/s  "
                  f"mem {memory:.1f} MiB", flush=True)  # fmt: skip
        if stopping:
            break
    if progress is not None:
        progress.close()
    if metrics is not None:
        metrics.close()  # report() reads it back for the plot
    if stopping:
        if lead:
            print(
                f"zero-train: {preemption.received.name if preemption.received else 'a signal'}"
                f" received: stopped after step {step + 1} of {args.steps}, saved "
                f"{args.out / CHECKPOINT}; the same command with --resume auto goes on from "
                f"there (exit code {EXIT_PREEMPTED})",
                flush=True,
            )
        run.close()
        sys.exit(EXIT_PREEMPTED)
    report(args, engine, metrics_comm, run.mesh.tp, history, lead)
    phases = metrics_comm.all_gather_object(phase_record(run.tracker, run.checkpointing))
    if lead:
        micro_tokens = args.batch_size // run.mesh.dp.world_size * run.config.context
        print("\n".join(phase_table(phases, run.config, micro_tokens, args.tp, args.checkpoint)))
    run.close()


def report(
    args: argparse.Namespace,
    engine: zero_core.ZeroEngine,
    metrics_comm: zero_comm.Communicator,
    tp: zero_comm.Communicator,
    history: list[tuple[int, float]],
    lead: bool,
) -> None:
    reports = metrics_comm.all_gather_object(engine.memory_report()._asdict())
    comm = engine.comm
    moved = comm.stats.total_volume_elements  # the last step's, before sampling gathers more
    sample = generate(engine.module, tp, args)  # every rank takes part (TP collectives)
    psi = sum(p.numel() for _, p in engine.trainable_parameters())
    width = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    k = state_bytes_per_param(width, "adamw")
    stage0 = zero_core.model_state_bytes(
        psi, 1, 0, optimizer_state_bytes=k, param_bytes=width, grad_bytes=width
    ).total
    tp_volume = float(tp.stats.total_volume_elements) / max(1, args.steps)
    if not lead:
        return
    print("\nmemory per rank, MiB (model states; stage 0 would hold"
          f" {mib(stage0).strip()} MiB of model states)")  # fmt: skip
    print("rank  parameters gradients    master optimizer  comm bufs  model states / stage 0")
    for rank, r in enumerate(reports):
        states = r["parameters"] + r["gradients"] + r["master_weights"] + r["optimizer_states"]
        print(f"{rank:4d} {mib(r['parameters'])} {mib(r['gradients'])} "
              f"{mib(r['master_weights'])} {mib(r['optimizer_states'])} "
              f"{mib(r['comm_buffers'])}   {mib(states)} / {mib(stage0)}  "
              f"({states / stage0:.2f}x)")  # fmt: skip
    n = comm.world_size
    factor = 3 if args.stage == 3 else 2
    paper = Fraction(factor * (n - 1) * psi, n)
    ratio = float(moved / paper) if paper else 0.0
    why = "bucket padding"
    if args.stage == 3:
        why += "; parameters kept whole (persistence threshold) move 2Ψ, not 3Ψ"
    print(f"\ncommunication in the last step: {float(moved):,.0f} elements per rank; the paper's "
          f"{factor}Ψ(N-1)/N = {float(paper):,.0f} (Ψ = {psi:,}; ratio {ratio:.3f}: "
          f"{why})")  # fmt: skip
    if args.tp > 1:
        print(f"tensor-parallel layers moved {tp_volume:,.0f} elements per rank per step "
              "(forward and backward all-reduces, loss reductions, sampling)")  # fmt: skip
    print(f"\nsample:\n{sample}\n")
    if history:
        (first, start), (last, end) = history[0], history[-1]
        print(f"loss: {start:.3f} at step {first + 1} -> {end:.3f} at step {last + 1}")
    # The whole run, earlier segments of a resumed one included.
    why_not = write_run_plots(args.out / "loss.png", read_metrics(args.out / "metrics.jsonl")[1])
    if why_not is None:
        print(f"wrote {args.out / 'metrics.jsonl'} and {args.out / 'loss.png'}")
    else:
        print(f"wrote {args.out / 'metrics.jsonl'}; {why_not}")


@torch.no_grad()
def generate(model: torch.nn.Module, tp: zero_comm.Communicator, args: argparse.Namespace) -> str:
    """Sample after "def " with the same generator on every rank; logits gathered over TP."""
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


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_options(argv)
    if detect_launch_env().launcher == "none" and args.nproc > 1:
        command = [
            sys.executable,
            "-m",
            "zero_models.train",
            *(sys.argv[1:] if argv is None else argv),
        ]
        sys.exit(launch(command, args.nproc, reported_codes=(EXIT_FAILED, EXIT_PREEMPTED)))
    train(args)


if __name__ == "__main__":
    main()
