"""What one rank of zero-train trains with: communicators, the GPT, the engine and its data.

    run = build_run(args)     # every rank of a launched job, args from parse_options
    ...
    run.close()               # every rank, at the end

``build_run`` is collective: every rank calls it with the same options, since it joins the
world (zero_comm.init) and splits it into the tensor- and data-parallel communicators. A rank
that runs out of memory building the model or the engine ends with one line
(out_of_memory).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

import zero_comm
import zero_core
from zero_comm.launcher_env import detect_launch_env
from zero_core.estimate.activations import TransformerShape
from zero_core.zero_r.activation_checkpoint import ActivationCheckpointing

from .checkpoint_plan import checkpoint_gpt_blocks
from .data import UINT16_SUFFIXES, BatchSampler, load_tokens
from .gpt import GPT, GPTConfig
from .hetero_emulation import SlotPadding
from .hetero_options import AUTO
from .hetero_profile import PROFILE_SLOTS, AutoChoice, resolve_auto
from .out_of_memory import (
    Footprint,
    Placement,
    advice,
    available_bytes,
    remove_swap_folders,
    size,
    stop_in_one_line,
)
from .tp_plan import Mesh, make_mesh, sharded_parameters, tensor_parallel_gpt
from .train_engine_config import DTYPES, run_zero_config
from .train_options import model_config


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
    checkpointing: ActivationCheckpointing | None
    footprint: Footprint  # what zero-estimate predicts, for a rank out of memory
    padding: SlotPadding  # --emulate-micro-batch-seconds (a no-op without)
    auto: AutoChoice | None  # what --micro-batches-per-rank/--shard-weights auto chose

    def close(self) -> None:
        """Close every communicator of this rank, the world last."""
        for comm in (self.metrics_comm, self.mesh.tp, self.mesh.dp):
            comm.close()
        self.world.close()


def build_run(args: argparse.Namespace, signalled: Callable[[], bool] = lambda: False) -> Run:
    """Communicators, the GPT (on meta without TP, its values streamed in), the
    engine and the data sampler of this rank. The data's vocabulary decides the model's:
    byte-level data (the default corpus, or tokens below 256) gets at least 256 tokens.

    Running out of memory in the build, or a peer's end met there, ends this rank with
    one line (out_of_memory.stop_in_one_line; ``signalled``: whether this rank has
    received a signal, which ends its wait to be stopped)."""
    world = zero_comm.init(
        args.backend,
        deterministic=True,
        timeout=args.comm_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    metrics_comm = world.split(color=0)
    mesh = make_mesh(world, args.tp)
    config = model_config(args)
    tokens = load_tokens(args.data)
    if args.data is None or tokens.max() < 256:
        config = config.with_overrides(vocab_size=max(config.vocab_size, 256))
    setup = getattr(args, "deepspeed_setup", None)
    emulated = args.emulate_micro_batch_seconds
    padding = SlotPadding(None if emulated is None else emulated[mesh.dp.rank])

    def make_engine(
        zero_config: zero_core.ZeroConfig,
    ) -> tuple[zero_core.Engine, ActivationCheckpointing | None]:
        """A fresh GPT of the seed, behind an engine of ``zero_config``."""
        model, init_values, model_parallel = build_model(args, config, world, mesh)
        checkpointing = checkpoint_gpt_blocks(
            model, args.checkpoint, mesh.tp, offload=args.offload_checkpoints
        )
        own_optimizer = setup is None or setup.optimizer is None
        optimizer = (
            torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
            if own_optimizer
            else None
        )
        # A --deepspeed config's engine, with what the flags add to it (run_zero_config).
        engine_config = (
            zero_config if setup is None else dataclasses.replace(setup, zero=zero_config)
        )
        engine = zero_core.initialize(
            model, optimizer, engine_config, mesh.dp, model_parallel=model_parallel,
            init_values=init_values,
        )  # fmt: skip
        return engine, checkpointing

    def profile_engine(counts: tuple[int, ...]) -> zero_core.Engine:
        """The engine 'auto' measures on: the run's, with ``counts`` and no accumulation."""
        return make_engine(profile_config(args, counts))[0]

    auto = None
    if AUTO in (args.micro_batches_per_rank, args.shard_weights):
        profiled = run_footprint(
            args, config, world.world_size, mesh.dp.world_size, world.device,
            profile_config(args, (PROFILE_SLOTS,) * mesh.dp.world_size),
        )  # fmt: skip
        with stop_in_one_line(
            world.rank, lambda: "the profile of auto", profiled, signalled=signalled, world=world
        ):  # fmt: skip
            auto = resolve_auto(
                args, profile_engine, tokens, config, mesh.dp, world.device, padding
            )
    # The ranks' choice replaces 'auto' (only 'auto') before the engine sees it.
    if auto is not None and args.micro_batches_per_rank == AUTO:
        args.micro_batches_per_rank = auto.counts
    if auto is not None and args.shard_weights == AUTO:
        args.shard_weights = auto.shard_weights
    zero_config = run_zero_config(args)
    footprint = run_footprint(
        args, config, world.world_size, mesh.dp.world_size, world.device, zero_config
    )
    with stop_in_one_line(
        world.rank, lambda: "the build", footprint, signalled=signalled, world=world,
        before=lambda: remove_swap_folders(zero_config.offload_dir),
    ):  # fmt: skip
        engine, checkpointing = make_engine(zero_config)
    counts = args.micro_batches_per_rank
    engine_counts = getattr(engine, "virtual_ranks", None)
    if counts is not None and engine_counts is not None and engine_counts.counts != counts:
        raise RuntimeError(
            f"[rank {world.rank}] the engine runs micro-batches per rank "
            f"{engine_counts.counts}, the sampler was given {counts}: a zero-train bug"
        )
    sampler = BatchSampler(
        tokens, context=config.context, global_batch=args.batch_size,
        dp_rank=mesh.dp.rank, dp_size=mesh.dp.world_size, seed=args.seed, counts=counts,
    )  # fmt: skip
    tracker = zero_core.MemoryTracker(world.device)
    return Run(
        world, metrics_comm, mesh, config, tokens, engine, sampler, tracker, checkpointing,
        footprint, padding, auto,
    )  # fmt: skip


def profile_config(args: argparse.Namespace, counts: tuple[int, ...]) -> zero_core.ZeroConfig:
    """The run's engine configuration with ``counts`` slots per rank, one micro-step per
    step, and even shards: what 'auto' profiles on (hetero_profile)."""
    changes: dict[str, object] = {
        "micro_batches_per_rank": counts,
        "gradient_accumulation_steps": 1,
    }
    if args.shard_weights is not None:
        changes["shard_weights"] = None
    base = run_zero_config(args)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def run_footprint(
    args: argparse.Namespace,
    config: GPTConfig,
    world_size: int,
    dp_size: int,
    device: torch.device,
    zero_config: zero_core.ZeroConfig,
) -> Footprint:
    """What zero-estimate needs of this run, and what this rank has before the build
    (the build's own call: tests cap a rank's memory by wrapping it)."""
    return footprint_of(args, config, world_size, dp_size, device, zero_config)


def footprint_of(
    args: argparse.Namespace,
    config: GPTConfig,
    world_size: int,
    dp_size: int,
    device: torch.device,
    zero_config: zero_core.ZeroConfig,
) -> Footprint:
    """:func:`run_footprint`'s figures, for a rank or, before the launch, for any."""
    dtype = {dtype: name for name, dtype in DTYPES.items()}[zero_config.param_dtype]
    # One micro-batch slot's (B / V; V = dp_size without --micro-batches-per-rank).
    tokens = args.batch_size // getattr(args, "virtual_total", dp_size) * config.context
    placement = Placement(
        zero_config.stage, args.checkpoint, zero_config.offload_optimizer,
        zero_config.offload_params,
    )  # fmt: skip
    shape = TransformerShape(config.layers, config.width, config.heads, config.vocab_size, tokens)
    launch = detect_launch_env()
    # Before the launch (no launcher): the ranks zero-train will start here.
    local_ranks = args.nproc if launch.launcher == "none" else launch.local_world_size
    # The build holds one parameter's float32 initial value (build_model), the largest an
    # embedding or an MLP matrix; with tensor parallelism the whole model, until sliced.
    largest = max(config.vocab_size, config.context, 4 * config.width) * config.width
    transient = 4.0 * (config.num_params if args.tp > 1 else largest)
    return Footprint(
        config.num_params / args.tp, world_size, dp_size, args.tp, dtype,
        placement, shape, device.type, zero_config, transient,
        available_bytes(device, local_ranks),
    )  # fmt: skip


# Refused before launch only past this many times what a rank has: the estimate is for
# the model states and one micro-step's activations, and a run near the line is left to
# try (and, if it runs out, to say so in one line with the flags that would fit).
PRELAUNCH_REFUSAL_FACTOR = 2.0


def prelaunch_memory_problem(args: argparse.Namespace) -> str:
    """Before any rank starts, on a CPU run: "" unless zero-estimate's prediction for a
    rank is more than PRELAUNCH_REFUSAL_FACTOR times the memory a rank of this node has
    (a --context of 1000000 ran for minutes in its first step, or was killed by the
    kernel without a word); else the line that says so, with the flags that would fit."""
    if args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available()):
        return ""  # the GPUs' memory is the ranks' to measure
    config = model_config(args)
    if args.data is None or Path(args.data).suffix not in UINT16_SUFFIXES:
        config = config.with_overrides(vocab_size=max(config.vocab_size, 256))
    zero_config = run_zero_config(args)
    launcher = detect_launch_env()
    world = args.nproc if launcher.launcher == "none" else launcher.world_size
    run = footprint_of(args, config, world, world // args.tp, torch.device("cpu"), zero_config)
    need = run.on_device(run.placement)
    if run.available is None or need <= PRELAUNCH_REFUSAL_FACTOR * run.available:
        return ""
    states, activations = run.split(run.placement)
    return (
        f"each rank would need about {size(need)} ({size(states)} of model states + "
        f"{size(activations)} of activations for one micro-step, zero-estimate's figures), "
        f"and has about {size(run.available)}: {advice(run)}"
    )


def build_model(
    args: argparse.Namespace, config: GPTConfig, world: zero_comm.Communicator, mesh: Mesh
) -> tuple[GPT, Iterator[tuple[str, torch.Tensor]] | None, zero_core.ModelParallel | None]:
    """The GPT of seed ``args.seed`` as the engine takes it: (model, init_values for
    zero_core.initialize or None, the tensor-parallel description or None).

    Without TP it is built on the meta device and its values streamed in, one parameter at
    a time, at every stage: set-up holds the stage's model states and one tensor more (at
    stage 3 no rank ever holds the model whole). With TP > 1 it is built whole on
    ``world.device``, then sliced for this rank's ``mesh.tp``."""
    init_values: Iterator[tuple[str, torch.Tensor]] | None = None
    if args.tp == 1:
        with torch.device("meta"):
            model = GPT(config, seed=args.seed)
        init_values = model.initial_values(args.seed)
    else:
        model = GPT(config, seed=args.seed).to(world.device)  # built whole, then placed
    model_parallel = None
    if args.tp > 1:
        tensor_parallel_gpt(model, mesh.tp)
        model_parallel = zero_core.ModelParallel.of(mesh.tp, sharded_parameters(model))
    return model, init_values, model_parallel
