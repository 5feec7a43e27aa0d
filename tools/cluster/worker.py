#!/usr/bin/env python
"""One launch of tools/cluster/bench.py: every variant of every model, rounds interleaved.

    torchrun --nnodes 2 --nproc-per-node 2 ... -m tools.cluster.worker \\
        --records out.jsonl --models small,large --variants flat,hybrid,... --rounds 3 \\
        --steps 3 --warmup 2 --dtype fp32 --batch-size 16

Every rank runs this (gloo, deterministic communicators, one torch thread); rank 0 writes
the JSON lines of ``--records`` that tools.cluster.report.parse_records reads:

    {"launch": {"world_size": 4, "topology": "...", "torch": "...", "params": {...}, ...}}
    {"model": "small", "variant": "flat", "round": -1, "step": 0, "step_s": ...,
     "loss": ..., "intra_node_bytes": ..., "inter_node_bytes": ..., "rank_step_s": [...]}

Our variants are zero-train's: each one's options come from zero-train's own parser
(``--stage 3``, the model's flags, tools.cluster.bench.VARIANTS' flags), and its model, engine
configuration, AdamW, learning-rate schedule and batches are what zero-train builds from
them (zero_models.run_setup.build_run does the same). Each trains on a communicator of its
own (``world.split``), built once per model and kept: its sub-communicators (node, shard and
hpZ groups) are made once, and its traffic is that communicator family's
``family_link_bytes``, as zero-train's metrics.jsonl counts it.

``fsdp2-hsdp`` is PyTorch FSDP2 (tools/peers/trainers.py's way: ``fully_shard`` on every
block, then the root, a GPT built on the meta device and filled from the same initial
values) on a 2-D DeviceMesh (replicate = nodes, shard = ranks per node): HSDP. Its traffic
is its torch.distributed calls (tools/peers/comm_hooks.py's hooks), each split into intra- and
inter-node bytes by the rule of zero_comm.stats (a ring collective's volume goes to the
rank's successor in its group: inter-node when that rank is on another node).

``deepspeed-hpz`` is DeepSpeed's ZeRO stage 3 with ZeRO++'s hpZ
(``zero_hpz_partition_size`` = ranks per node: a secondary copy of the parameters sharded
inside a node, which backward gathers from), fp32, on the world group DeepSpeed takes from
torch.distributed (its hpZ groups are consecutive ranks: one node's with node-major ranks).
The same GPT and initial values (``GPT(config, seed)`` on the CPU), batches, torch AdamW,
schedule and clipping (DeepSpeed's ``gradient_clipping``) as the others; its reduce bucket,
live parameters and persistence threshold are our engine's defaults, and two knobs are 0 so
that backward gathers again, as hpZ needs: ``stage3_max_reuse_distance`` (its default, 1e9
elements, keeps every parameter gathered in forward until backward on models this small)
and ``stage3_prefetch_bucket_size`` (once its trace is recorded it prefetches, and a
prefetched parameter is not released: with our 2**22 window, the whole model here, no
backward gather happened from the second step on, every collective was the world's). Its
traffic is counted as FSDP2's is: DeepSpeed calls the collectives of torch.distributed,
which comm_hooks hooks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import statistics
import sys
import time
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

import zero_comm
import zero_core
from tools.cluster.bench import DEEPSPEED_HPZ, FSDP2_HSDP, MODELS, VARIANTS, variant_order
from tools.peers import comm_hooks
from tools.peers.trainers import Hyper, Trainer, fsdp2_gpt_on_mesh, next_token_loss
from zero_comm.stats import ring_volume
from zero_models.data import BatchSampler, load_tokens
from zero_models.gpt import GPT, GPTConfig
from zero_models.train_engine_config import DTYPES, hierarchy_settings
from zero_models.train_options import model_config, parse_options
from zero_models.train_schedule import learning_rate

RECORD_STATS = 4  # step_s, loss, intra-node bytes, inter-node bytes (per rank, gathered)
# torch's own, before any peer is built: DeepSpeed's stage 3 replaces it (see DeepSpeedHpz).
TORCH_LINEAR = torch.nn.functional.linear


def zero_train_options(model: str, flags: list[str], dtype: str, batch: int) -> argparse.Namespace:
    """zero-train's options for one variant, through its own parser and checks."""
    return parse_options(
        ["--stage", "3", *MODELS[model], "--dtype", dtype, "--batch-size", str(batch), *flags]
    )


def gpt_config(args: argparse.Namespace, tokens: torch.Tensor) -> GPTConfig:
    """The GPT zero-train trains for ``args`` on ``tokens`` (byte-level: vocabulary >= 256)."""
    config = model_config(args)
    if args.data is None or tokens.max() < 256:
        config = config.with_overrides(vocab_size=max(config.vocab_size, 256))
    return config


class BenchTrainer(Trainer):
    """tools.peers.trainers.Trainer, plus what this benchmark needs of every variant."""

    def set_lr(self, lr: float) -> None:
        raise NotImplementedError

    def link_bytes(self) -> tuple[float, float]:
        """(intra-node, inter-node) bytes this rank has sent so far, ring convention."""
        raise NotImplementedError


class ZeroTrainVariant(BenchTrainer):
    """Our stage 3 engine as zero-train builds it for ``args`` (its hierarchy flags too)."""

    def __init__(
        self, name: str, args: argparse.Namespace, config: GPTConfig, comm: zero_comm.Communicator
    ) -> None:
        self.name = name
        self.comm = comm
        with torch.device("meta"):
            model = GPT(config, seed=args.seed)
        zero_config = zero_core.ZeroConfig(
            stage=3,
            param_dtype=DTYPES[args.dtype],
            gradient_accumulation_steps=args.grad_accum,
            clip_grad_norm=args.clip or None,
            **hierarchy_settings(args),
        )
        self.engine = zero_core.initialize(
            model,
            Hyper(lr=args.lr).adamw(model.parameters()),  # zero-train's AdamW options
            zero_config,
            comm,
            init_values=model.initial_values(args.seed),
        )

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.engine(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        if not self.engine.step():
            raise RuntimeError(f"[rank {self.comm.rank}] {self.name}: step() was skipped")

    def link_bytes(self) -> tuple[float, float]:
        intra, inter = self.comm.family_link_bytes()
        return float(intra), float(inter)

    def close(self) -> None:
        self.engine.close()
        del self.engine


class LinkCounter(comm_hooks.CallCounter):
    """comm_hooks's counter of every group's calls, also split by link class as
    zero_comm.stats splits a ring collective: the whole volume goes to this rank's successor
    in the group, intra-node when that rank shares this rank's node."""

    def __init__(self, node_of: tuple[int, ...]) -> None:
        super().__init__(comm_hooks.ANY_GROUP)
        self.node_of = node_of
        self.intra = 0.0
        self.inter = 0.0

    def record(self, collective: str, numel: int, itemsize: int, group: Any) -> None:
        super().record(collective, numel, itemsize, group)
        ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        me = ranks.index(dist.get_rank())
        successor = ranks[(me + 1) % len(ranks)]
        volume = float(ring_volume(collective, numel, len(ranks))) * itemsize
        if self.node_of[successor] == self.node_of[ranks[me]]:
            self.intra += volume
        else:
            self.inter += volume

    def reset(self) -> None:
        super().reset()
        self.intra = self.inter = 0.0


def hsdp_gpt(config: GPTConfig, seed: int, mesh: Any, dtype: torch.dtype) -> nn.Module:
    """tools.peers.trainers.fsdp2_gpt_on_mesh on a 2-D (replicate, shard) mesh: HSDP. With a 16-bit
    ``dtype`` FSDP2 computes and communicates in it (MixedPrecisionPolicy), fp32 master."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    return fsdp2_gpt_on_mesh(config, seed, mesh, mp_policy=policy)


class FsdpHsdp(BenchTrainer):
    """FSDP2's HSDP: shard over one node's ranks, replicate across nodes."""

    name = "fsdp2-hsdp"

    def __init__(
        self, args: argparse.Namespace, config: GPTConfig, topology: zero_comm.Topology
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        per_node = topology.ranks_per_node
        if per_node is None or topology.node_of != tuple(
            r // per_node for r in range(topology.world_size)
        ):
            raise ValueError(
                f"fsdp2-hsdp needs node-major ranks, the same number on every node; the "
                f"topology here is {topology}"
            )
        mesh = init_device_mesh(
            "cpu", (topology.num_nodes, per_node), mesh_dim_names=("replicate", "shard")
        )
        self.clip = args.clip
        self.model = hsdp_gpt(config, args.seed, mesh, DTYPES[args.dtype])
        self.optimizer = Hyper(lr=args.lr).adamw(self.model.parameters())
        self.counter = LinkCounter(topology.node_of)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.counter:
            return next_token_loss(self.model(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        with self.counter:
            torch.autograd.backward(loss)

    def optimizer_step(self) -> None:
        with self.counter:
            if self.clip:  # as zero-train's engine clips (the global norm, before the step)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def link_bytes(self) -> tuple[float, float]:
        return self.counter.intra, self.counter.inter

    def close(self) -> None:
        del self.optimizer, self.model


class DeepSpeedHpz(BenchTrainer):
    """DeepSpeed's stage 3 with hpZ (zero_hpz_partition_size = ranks per node), fp32."""

    name = DEEPSPEED_HPZ

    def __init__(
        self, args: argparse.Namespace, config: GPTConfig, topology: zero_comm.Topology,
        world_size: int,
    ) -> None:  # fmt: skip
        per_node = topology.ranks_per_node
        if (
            per_node is None
            or per_node < 2
            or topology.node_of != tuple(r // per_node for r in range(topology.world_size))
        ):
            raise ValueError(
                f"{self.name} needs node-major ranks, at least 2 on every node (DeepSpeed's "
                f"hpZ groups are consecutive ranks); the topology here is {topology}"
            )
        if args.dtype != "fp32" or args.grad_accum != 1:
            raise ValueError(
                f"{self.name} runs fp32 with one micro-batch per step; got --dtype "
                f"{args.dtype} --grad-accum {args.grad_accum}: leave it out of --variants"
            )
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed = importlib.import_module("deepspeed")  # after comm_hooks.install()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # takes torch's initialised world
        ours = zero_core.ZeroConfig(stage=3)
        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch_size // world_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                "zero_hpz_partition_size": per_node,
                "reduce_bucket_size": ours.bucket_numel,
                "stage3_max_live_parameters": ours.max_live_numel,
                "stage3_param_persistence_threshold": ours.persistence_threshold,
                # release after use, prefetch nothing: backward gathers (hpZ); see above
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 0,
            },
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,  # the same torch AdamW as the others
            "gradient_clipping": args.clip,  # 0: off, as zero-train's --clip 0
            "steps_per_print": 2**30,
            "wall_clock_breakdown": False,
        }
        self.counter = LinkCounter(topology.node_of)
        model = GPT(config, seed=args.seed)  # on the CPU: GPT's initial values for the seed
        with self.counter:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=Hyper(lr=args.lr).adamw(model.parameters()),
                config=ds_config,
            )  # fmt: skip
        self.counter.reset()  # the steps' calls only, not initialize's
        # DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process
        # with its memory-efficient autograd function ("this will persist unless manually
        # reset"). Left there, every other variant's nn.Linear ran it too: other bits
        # (ZeRO++'s loss after 8 steps moved from 4.4808459 to 4.4808565) and other costs.
        # It is DeepSpeed's only while DeepSpeed's forward runs.
        self.linear = torch.nn.functional.linear
        torch.nn.functional.linear = TORCH_LINEAR
        self.version = str(deepspeed.__version__)
        self.partition_size = self.engine.zero_hpz_partition_size()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        torch.nn.functional.linear = self.linear
        try:
            with self.counter:
                return next_token_loss(self.engine(inputs), targets)
        finally:
            torch.nn.functional.linear = TORCH_LINEAR

    def backward(self, loss: torch.Tensor) -> None:
        with self.counter:
            self.engine.backward(loss)

    def optimizer_step(self) -> None:
        with self.counter:
            self.engine.step()
        if self.engine.skipped_steps:
            raise RuntimeError(f"[rank {dist.get_rank()}] {self.name}: a step was skipped")

    def link_bytes(self) -> tuple[float, float]:
        return self.counter.intra, self.counter.inter

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.optimizer


def check_torch_linear() -> None:
    """Raise unless ``torch.nn.functional.linear`` is torch's own: every variant of a
    launch shares the process, so a peer that replaced it would run in all of them."""
    if torch.nn.functional.linear is not TORCH_LINEAR:
        raise RuntimeError(
            f"torch.nn.functional.linear is {torch.nn.functional.linear!r}, not torch's: a "
            "peer replaced it for the whole process, so every variant would run it; restore "
            "it after building the peer and install it only around the peer's forward (as "
            "DeepSpeedHpz does)"
        )


def build(
    name: str, args: argparse.Namespace, config: GPTConfig, world: zero_comm.Communicator
) -> BenchTrainer:
    if name == FSDP2_HSDP:
        return FsdpHsdp(args, config, world.topology)
    if name == DEEPSPEED_HPZ:
        return DeepSpeedHpz(args, config, world.topology, world.world_size)
    if VARIANTS[name] is None:
        raise ValueError(f"{name}: a variant that is not zero-train's needs a trainer here")
    return ZeroTrainVariant(name, args, config, world.split(color=0))


class Launch:
    """This rank's part of the launch: the world, a communicator for the benchmark's own
    barriers and gathers (outside every variant's statistics), rank 0's records file."""

    def __init__(self, records: IO[str] | None) -> None:
        self.world = zero_comm.init("gloo", deterministic=True)
        self.metrics = self.world.split(color=0)
        self.records = records

    def write(self, record: dict[str, Any]) -> None:
        if self.records is not None:
            self.records.write(json.dumps(record) + "\n")
            self.records.flush()

    def say(self, text: str) -> None:
        if self.world.rank == 0:
            print(f"[bench_cluster_worker] {text}", flush=True)

    def step(
        self, model: str, trainer: BenchTrainer, batch: tuple[torch.Tensor, torch.Tensor],
        round_index: int, step: int,
    ) -> float:  # fmt: skip
        """One timed training step of ``trainer`` on every rank; rank 0 records it. Returns
        the slowest rank's seconds."""
        self.metrics.barrier()
        intra0, inter0 = trainer.link_bytes()
        start = time.perf_counter()
        loss = trainer.forward(*batch)
        trainer.backward(loss)
        trainer.optimizer_step()
        seconds = time.perf_counter() - start
        intra1, inter1 = trainer.link_bytes()
        mine = torch.tensor(
            [seconds, float(loss.detach()), intra1 - intra0, inter1 - inter0], dtype=torch.float64
        )
        table = torch.empty(RECORD_STATS * self.world.world_size, dtype=torch.float64)
        self.metrics.all_gather(table, mine)
        rows = table.view(-1, RECORD_STATS)
        self.write(
            {
                "model": model,
                "variant": trainer.name,
                "round": round_index,
                "step": step,
                "step_s": float(rows[:, 0].max()),
                "loss": float(rows[:, 1].mean()),
                "intra_node_bytes": round(float(rows[:, 2].sum())),
                "inter_node_bytes": round(float(rows[:, 3].sum())),
                "rank_step_s": [round(float(v), 5) for v in rows[:, 0]],
            }
        )
        return float(rows[:, 0].max())


def run_model(launch: Launch, model: str, cli: argparse.Namespace) -> dict[str, Any]:
    """Build every variant of ``model``, warm each up, run the rounds, close them."""
    options = {
        name: zero_train_options(model, flags or [], cli.dtype, cli.batch_size)
        for name, flags in ((v, VARIANTS[v]) for v in cli.variants)
    }
    reference = options[cli.variants[0]]
    tokens = load_tokens(reference.data)
    config = gpt_config(reference, tokens)
    world = launch.world
    sampler = BatchSampler(
        tokens, context=config.context, global_batch=reference.batch_size,
        dp_rank=world.rank, dp_size=world.world_size, seed=reference.seed,
    )  # fmt: skip
    trainers = {name: build(name, options[name], config, world) for name in cli.variants}
    done = dict.fromkeys(cli.variants, 0)

    def block(name: str, round_index: int, steps: int) -> None:
        trainer, args = trainers[name], options[name]
        check_torch_linear()
        times = []
        for _ in range(steps):
            step = done[name]
            trainer.set_lr(learning_rate(step, args))
            times.append(launch.step(model, trainer, sampler.batch(step), round_index, step))
            done[name] += 1
        if times:
            launch.say(f"{model} {name} round {round_index}: median step "
                       f"{statistics.median(times):.3f} s")  # fmt: skip

    for name in variant_order(cli.variants, 0):
        block(name, -1, cli.warmup)
    for round_index in range(cli.rounds):
        for name in variant_order(cli.variants, round_index):
            block(name, round_index, cli.steps)
    notes = []
    for peer in (trainers.get(FSDP2_HSDP), trainers.get(DEEPSPEED_HPZ)):
        if isinstance(peer, FsdpHsdp | DeepSpeedHpz) and not peer.counter.calls:
            notes.append(f"{model}: {peer.name}'s collectives were not seen by the hooks: its "
                         "bytes read 0")  # fmt: skip
    deepspeed = trainers.get(DEEPSPEED_HPZ)
    if isinstance(deepspeed, DeepSpeedHpz):
        notes.append(
            f"{model}: {DEEPSPEED_HPZ} ran DeepSpeed {deepspeed.version}'s stage 3 with "
            f"zero_hpz_partition_size={deepspeed.partition_size}"
        )
    for trainer in trainers.values():
        trainer.close()
    return {"params": config.num_params, "config": config.__dict__, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--records", required=True, help="JSON lines, written by rank 0")
    parser.add_argument(
        "--models", required=True, help="comma-separated, tools.cluster.bench.MODELS"
    )
    parser.add_argument("--variants", required=True, help="comma-separated; the first is flat")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--batch-size", type=int, default=16)
    cli = parser.parse_args(argv)
    cli.models = cli.models.split(",")
    cli.variants = cli.variants.split(",")
    torch.set_num_threads(1)
    comm_hooks.install()  # before FSDP2 runs: its collectives are counted through the hooks
    records = None
    launch = Launch(None)
    if launch.world.rank == 0:
        records = open(cli.records, "w")  # noqa: SIM115 (closed at the end of main)
        launch.records = records
    try:
        described: dict[str, Any] = {
            "world_size": launch.world.world_size,
            "topology": str(launch.world.topology),
            "topology_source": launch.world.topology.source,
            "torch": torch.__version__,
            "threads_per_rank": torch.get_num_threads(),
            "params": {},
            "notes": [],
        }
        launch.say(f"{launch.world.world_size} ranks, topology {launch.world.topology} "
                   f"({launch.world.topology.source})")  # fmt: skip
        if launch.world.topology.num_nodes < 2:
            raise RuntimeError(
                f"[rank {launch.world.rank}] one node only ({launch.world.topology}): run this "
                "under tools/cluster/emulated.py (torchrun --nnodes 2), as tools.cluster.bench does"
            )
        for model in cli.models:
            result = run_model(launch, model, cli)
            described["params"][model] = result["params"]
            described["notes"] += result["notes"]
        launch.write({"launch": described})
    finally:
        if records is not None:
            records.close()
    launch.metrics.close()
    launch.world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
