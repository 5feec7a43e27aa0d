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
import math
import os
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import torch
from torch.nn import functional as F

import zero_comm
import zero_core
from zero_comm.launch import launch
from zero_comm.launcher_env import detect_launch_env

from .checkpoint_plan import CHECKPOINT_MODES, checkpoint_gpt_blocks
from .data import BatchSampler, load_tokens
from .gpt import GPT, PRESETS, GPTConfig
from .phase_memory import phase_record, phase_table
from .run_metrics import corpus_digest, open_metrics
from .tp_layers import vocab_parallel_cross_entropy
from .tp_mappings import gather_last_dim
from .tp_plan import check_tp_degree, make_mesh, sharded_parameters, tensor_parallel_gpt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HIGHEST_STAGE = max(zero_core.AVAILABLE_STAGES)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zero-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="JSON file of option values (flags override it)")
    p.add_argument("--stage", type=int, default=HIGHEST_STAGE, help="ZeRO stage (default: highest)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks when run by hand")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides ranks)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "mpi", "auto"))
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    for name in ("layers", "heads", "width", "context"):
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument(
        "--checkpoint", default="none", choices=CHECKPOINT_MODES,
        help="activation checkpointing of the blocks; partitioned = ZeRO-R's P_a over --tp",
    )  # fmt: skip
    p.add_argument(
        "--offload-checkpoints", action="store_true",
        help="keep activation checkpoints in host memory (P_a+cpu; needs --checkpoint)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="text file, folder, or .bin/.u16 uint16 tokens")
    p.add_argument("--out", type=Path, default=Path("runs/zero-train"))
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint to OUT/checkpoint every N steps and at the end",
    )
    p.add_argument("--resume", type=Path, help="continue from this checkpoint (any stage, ranks)")
    p.add_argument(
        "--threads", type=int,
        help="intra-op threads per rank (default: OMP_NUM_THREADS, else this node's cores / "
        "its ranks); results are bitwise reproducible only at the same count",
    )  # fmt: skip
    p.add_argument(
        "--stop-after", type=int, metavar="STEP",
        help="end after this step, as if cut off there: the schedule stays that of --steps",
    )  # fmt: skip
    return p


def config_flags(p: argparse.ArgumentParser, path: Path) -> list[str]:
    """The --config JSON file as flags, to go before the command line's (which win):
    {"steps": 7, "batch_size": 4} -> ["--steps", "7", "--batch-size", "4"]. Each value is
    then checked by its option like a typed flag; anything else stops with usage."""
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--config {path}: cannot read a JSON object from it ({exc})")
    if not isinstance(values, dict):
        p.error(f"--config {path}: must hold a JSON object of option values, not {values!r}")
    options = {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(str(k) for k in set(values) - set(options))
    if unknown:
        p.error(f"--config {path}: unknown keys {unknown}")
    flags: list[str] = []
    for key, value in values.items():
        if key == "config" or not isinstance(value, str | int | float) or isinstance(value, bool):
            p.error(f"--config {path}: {key}={value!r} must be a number or text")
        flags += [options[key].option_strings[0], str(value)]
    return flags


def parse_options(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options from --config, then flags; every check that can fail before launching."""
    p = parser()
    args = p.parse_args(argv)
    if args.config is not None:
        args = p.parse_args([*config_flags(p, args.config), *(argv or sys.argv[1:])])
    if args.stage not in (0, 1, 2, 3):
        p.error(f"--stage {args.stage}: ZeRO stages are 0-3")
    if args.nproc < 1 or args.steps < 1 or args.grad_accum < 1 or args.batch_size < 1:
        p.error("--nproc, --steps, --grad-accum and --batch-size must be at least 1")
    if args.offload_checkpoints and args.checkpoint == "none":
        p.error("--offload-checkpoints needs --checkpoint full or --checkpoint partitioned")
    if args.data is not None and not Path(args.data).exists():
        p.error(f"--data {args.data}: no such file or folder")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after {args.stop_after} must be a step from 1 to --steps ({args.steps})")
    if args.save_every < 0:
        p.error(f"--save-every {args.save_every} must be 0 (never) or a number of steps")
    if args.resume is not None and not any(
        (folder / "index.json").exists()
        for folder in (args.resume, args.resume.with_name(args.resume.name + ".old"))
    ):
        p.error(f"--resume {args.resume}: no checkpoint there (no index.json)")
    try:
        config = model_config(args)
        if args.tp < 1:
            raise ValueError(f"--tp {args.tp} must be at least 1")
        launcher = detect_launch_env()
        world = args.nproc if launcher.launcher == "none" else launcher.world_size
        if world % args.tp:
            raise ValueError(
                f"--tp {args.tp} does not divide the {world} ranks; use --nproc (or -n) that is "
                f"a multiple of {args.tp}"
            )
        check_tp_degree(config.heads, config.width, max(config.vocab_size, 256), args.tp)
    except ValueError as exc:
        p.error(str(exc))
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    return PRESETS[args.model].with_overrides(
        layers=args.layers, heads=args.heads, width=args.width, context=args.context
    )


def threads_per_rank(requested: int | None, local_ranks: int) -> tuple[int, str]:
    """The intra-op threads each rank computes with, and where the number came from:
    --threads, else OMP_NUM_THREADS, else this node's cores shared among its ranks."""
    cores = os.cpu_count() or 1
    shared = max(1, cores // max(1, local_ranks))
    if requested is not None:
        return requested, "--threads"
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) >= 1:
        if int(value) == shared:
            return shared, f"{cores} cores / {local_ranks} ranks on this node"
        return int(value), "OMP_NUM_THREADS"
    return shared, f"{cores} cores / {local_ranks} ranks on this node"


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to a tenth of it."""
    if step < args.warmup:
        return float(args.lr * (step + 1) / args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return float(args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))))


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def train(args: argparse.Namespace) -> None:
    threads, threads_from = threads_per_rank(args.threads, detect_launch_env().local_world_size)
    torch.set_num_threads(threads)
    world = zero_comm.init(args.backend, deterministic=True)
    metrics_comm = world.split(color=0)  # logging traffic kept out of the engine's stats
    mesh = make_mesh(world, args.tp)
    comm = mesh.dp
    config = model_config(args)
    dtype = DTYPES[args.dtype]
    tokens = load_tokens(args.data)
    if args.data is None or tokens.max() < 256:
        config = config.with_overrides(vocab_size=max(config.vocab_size, 256))
    init_values = None
    if args.stage == 3 and args.tp == 1:
        # Built on the meta device: each rank keeps only its shards of each value.
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
    tracker = zero_core.MemoryTracker(world.device)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)),
        zero_core.ZeroConfig(
            stage=args.stage,
            param_dtype=dtype,
            gradient_accumulation_steps=args.grad_accum,
            clip_grad_norm=args.clip or None,
        ),
        comm,
        model_parallel=model_parallel,
        init_values=init_values,
    )
    sampler = BatchSampler(
        tokens,
        context=config.context,
        global_batch=args.batch_size,
        dp_rank=comm.rank,
        dp_size=comm.world_size,
        seed=args.seed,
    )
    lead = world.rank == 0
    first_step = 0
    if args.resume is not None:
        first_step = int(engine.load(args.resume).get("step", 0))
    if lead:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.resume is not None:
            print(f"zero-train: resumed from {args.resume} at step {first_step}", flush=True)
        print(
            f"zero-train: GPT {config.layers}x{config.width} ({config.num_params / 1e6:.2f}M "
            f"parameters), stage {args.stage}, {world.world_size} ranks ({args.tp} tensor-parallel"
            f" x {comm.world_size} data-parallel) on {comm.backend}, "
            f"{args.dtype}, {tokens.numel():,} tokens of data, {threads} "
            f"thread{'s' if threads > 1 else ''} per rank ({threads_from})",
            flush=True,
        )
    metrics = None
    if lead:
        run_record = {
            "fingerprint": engine.fingerprint().to_json(),
            "corpus": corpus_digest(tokens),
            "first_step": first_step,
            "argv": sys.argv[1:],
        }
        metrics = open_metrics(args.out / "metrics.jsonl", run_record, append=first_step > 0)
    history: list[tuple[int, float]] = []
    start = time.perf_counter()
    tokens_per_step = args.batch_size * args.grad_accum * config.context
    end_step = args.steps if args.stop_after is None else args.stop_after
    for step in range(first_step, end_step):
        step_start = time.perf_counter()
        if step == end_step - 1:
            comm.stats.reset()  # the last step's traffic is what gets reported
        lr = learning_rate(step, args)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(args.grad_accum):
            inputs, targets = (t.to(world.device) for t in sampler.batch(step, micro))
            with tracker.phase("forward"):
                logits = engine(inputs)
                if args.tp > 1:
                    loss = vocab_parallel_cross_entropy(logits, targets, mesh.tp)
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
        mean = torch.tensor([total])
        metrics_comm.all_reduce(mean, zero_comm.ReduceOp.AVG)
        # Every rank's resident memory and step time, for the soak report (tools/soak.py).
        mine = torch.tensor([resident_mib(), time.perf_counter() - step_start], dtype=torch.float64)
        per_rank = torch.empty(2 * metrics_comm.world_size, dtype=torch.float64)
        metrics_comm.all_gather(per_rank, mine)
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == end_step):
            # The step to start from, and the seed: the data order and the learning rate
            # are functions of those, so a resumed run continues bit for bit.
            engine.save(args.out / "checkpoint", extra={"step": step + 1, "seed": args.seed})
        elapsed = time.perf_counter() - start
        if lead and metrics is not None:
            rate = tokens_per_step * (step + 1 - first_step) / elapsed
            history.append((step, float(mean.item())))
            table = per_rank.view(-1, 2)
            record = {"step": step, "loss": mean.item(), "lr": lr,
                      "tokens_per_s": round(rate, 1), "elapsed_s": round(elapsed, 2),
                      "step_s": round(float(table[:, 1].max()), 5),
                      "rss_mib": [round(float(v), 2) for v in table[:, 0]]}  # fmt: skip
            metrics.write(json.dumps(record) + "\n")
            memory = engine.memory_report().total
            line = (
                f"step {step + 1:5d}/{args.steps}  loss {mean.item():.4f}  "
                f"{rate:8.0f} tok/s  mem {memory / 2**20:.1f} MiB"
            )
            if sys.stdout.isatty():
                print("\r" + line, end="", flush=True)
            elif step % max(1, args.steps // 20) == 0 or step == end_step - 1:
                print(line, flush=True)
    if lead and sys.stdout.isatty():
        print()
    report(args, engine, metrics_comm, mesh.tp, history, lead)
    phases = metrics_comm.all_gather_object(phase_record(tracker, checkpointing))
    if lead:
        micro_tokens = args.batch_size // comm.world_size * config.context
        print("\n".join(phase_table(phases, config, micro_tokens, args.tp, args.checkpoint)))
    if metrics is not None:
        metrics.close()
    for sub_comm in (metrics_comm, mesh.tp, mesh.dp):
        sub_comm.close()
    world.close()


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
    # Adam's two moments, plus a float32 master unless the parameters are float32 themselves.
    k = 8 if width == 4 else 12
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
    try:
        from .loss_plot import write_loss_png

        write_loss_png(args.out / "loss.png", [s for s, _ in history], [v for _, v in history])
        print(f"wrote {args.out / 'metrics.jsonl'} and {args.out / 'loss.png'}")
    except ImportError:
        print(f"wrote {args.out / 'metrics.jsonl'}")


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
        sys.exit(launch(command, args.nproc))
    train(args)


if __name__ == "__main__":
    main()
