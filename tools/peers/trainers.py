"""One trainer per framework, all training the same GPT the same way, for tools/peers/bench.py.

Every trainer starts from ``GPT(config, seed)``'s initial values, uses AdamW (fp32, the same
hyper-parameters), the loss ``cross_entropy(logits, next tokens)``, and offers:

    loss = trainer.forward_backward(inputs, targets)   # gradients reduced as the peer does
    trainer.optimizer_step()                           # update (and re-gather, where sharded)
    trainer.state_bytes()                              # model states held now, from tensors
    trainer.comm_bytes_reset(); trainer.comm_bytes()   # ring-convention bytes since the reset

Variants (``VARIANTS``): ``ours-0`` .. ``ours-3`` (``zero_core.initialize``), ``ddp``
(``DistributedDataParallel``, ``gradient_as_bucket_view=True``), ``zero-redundancy``
(``ZeroRedundancyOptimizer`` over DDP, its defaults: one broadcast per parameter),
``fsdp2`` (``fully_shard`` on every block, then the root) and ``deepspeed-1`` ..
``deepspeed-3``; ``ours-0-det`` .. ``ours-3-det`` are our engines with ``deterministic=True``
communicators. Each runs on its own process group, split from the world, except DeepSpeed,
which takes no group: it clones the world group itself.

Activation checkpointing (``checkpoint="full"``, the same for every variant): each
transformer block keeps only its input and runs its forward again in backward; the hooks
the frameworks put on a block (stage 3's and FSDP2's gathers, DeepSpeed's fetches) stay
outside the checkpoint, on the block's ``__call__``, as ``checkpoint_gpt_blocks`` arranges:

    block.__call__ -> framework pre-hooks -> block.forward = checkpointed(original forward)

Ours: ``zero_models.checkpoint_plan.checkpoint_gpt_blocks(model, "full", contiguous=False)``
(``zero_core.ActivationCheckpointing``, the library's own, as ``zero-train --checkpoint full``
uses it: an autograd Function that keeps the block's input itself and, in its backward,
recomputes the block and runs backward through it). The peers (DDP, ZeroRedundancyOptimizer,
FSDP2, DeepSpeed): ``torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)`` per
block. DeepSpeed's own ``deepspeed.checkpointing.checkpoint`` is the reentrant kind and wants
a global ``deepspeed.checkpointing.configure``; torch's non-reentrant one runs under its
ZeRO 1-3 here unchanged (the smoke run's losses equal the other variants'). Both kinds keep
one (B, T, C) tensor per block between forward and backward.

Model states are counted from the tensors each framework holds, distinct storages once:
parameters (this rank's local tensors: shards for FSDP2 and DeepSpeed stage 3), gradients,
optimizer states (Adam's moments, plus fp32 master copies where the framework keeps them). For
DeepSpeed, every tensor reachable from its ZeRO optimizer object that is none of those (flat
buffers, gradient partitions, communication buckets) counts under ``other``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

import zero_comm
import zero_core
from tools.peers import comm_hooks
from zero_models.gpt import GPT, GPTConfig

BUCKET_NUMEL = 2**22  # ours (ZeroConfig default) and DeepSpeed's reduce/all-gather buckets
OURS = ("ours-0", "ours-1", "ours-2", "ours-3")
# The same engines on a communicator with deterministic=True (rank-ordered reductions).
OURS_DET = tuple(f"{v}-det" for v in OURS)
TORCH_PEERS = ("ddp", "zero-redundancy", "fsdp2")
DEEPSPEED = ("deepspeed-1", "deepspeed-2", "deepspeed-3")
# Our stage 3 with model states offloaded (ZeRO-Infinity): "-disk" puts the master weights,
# optimizer states and parameter shards in swap files under $ZERO_BENCH_OFFLOAD_DIR (else
# the temporary folder), "-cpu" in host memory (the same memory on a CPU-only machine).
OURS_OFFLOAD = ("ours-3-disk", "ours-3-cpu")
# DeepSpeed's stage 3 with offload_optimizer and offload_param on "cpu" (its NVMe tier
# needs libaio), stepping the same torch AdamW.
DEEPSPEED_OFFLOAD = ("deepspeed-3-cpu",)
# The optimizer step fused into backward, each parameter's shard stepped as soon as its
# gradient is reduced and the gradient freed: ours (ZeroConfig.optimizer_in_backward) and
# FSDP2 with one AdamW per parameter stepped by a post-accumulate-grad hook (FSDP2 runs
# those hooks on its sharded parameters after each reduce-scatter; torch's recipe).
IN_BACKWARD = ("ours-3-in-bwd", "fsdp2-in-bwd")
VARIANTS = (
    *OURS, *TORCH_PEERS, *DEEPSPEED, *OURS_DET, *OURS_OFFLOAD, *DEEPSPEED_OFFLOAD, *IN_BACKWARD,
)  # fmt: skip
DEFAULT_VARIANTS = (*OURS, *TORCH_PEERS, *DEEPSPEED)


class StateBytes(NamedTuple):
    """Bytes one rank holds, by category; ``model_states`` is the paper's."""

    parameters: int
    gradients: int
    optimizer_states: int
    other: int
    host: int = 0  # offloaded model states in host memory
    disk: int = 0  # offloaded model states in swap files

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


class Hyper(NamedTuple):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1

    def adamw(self, params: Iterable[Any]) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay
        )


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """data_ptr -> bytes of the distinct, allocated storages among ``tensors``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = local(tensor).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return seen


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield value


def reachable_tensors(root: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """Tensors in ``root``'s attributes, lists, tuples and dicts, ``depth`` levels down."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    visited: set[int] = set()
    while stack:
        obj, level = stack.pop()
        if id(obj) in visited or level > depth:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            stack += [(v, level + 1) for v in obj.values()]
        elif isinstance(obj, list | tuple):
            stack += [(v, level + 1) for v in obj]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [(obj.state, level + 1), (obj.param_groups, level + 1)]
        elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module | type):
            stack += [(v, level + 1) for v in vars(obj).values()]


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    return GPT(config, seed=seed)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


CHECKPOINT_MODES = ("none", "full")


def checkpoint_blocks_with_torch(model: GPT) -> None:
    """Every block of ``model`` recomputed in backward by torch's non-reentrant checkpoint
    (the peers' side of ``checkpoint="full"``; module hooks stay outside, as in
    ``zero_models.checkpoint_plan``)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        run_block = block.forward
        block.forward = lambda x, run_block=run_block: checkpoint(  # type: ignore[method-assign]
            run_block, x, use_reentrant=False
        )


class Trainer:
    """What tools.peers.bench drives; subclasses fill in the framework.

    ``forward`` returns the loss tensor, ``backward`` runs backward and the gradient
    reduction; ``forward_backward`` is both (the measured phases, zero_core.MemoryTracker's
    "forward" and "backward", are these two calls; "step" is ``optimizer_step``)."""

    name = "?"

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.forward(inputs, targets)
        self.backward(loss)
        return float(loss.item())

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> StateBytes:
        raise NotImplementedError

    def comm_bytes_reset(self) -> None:
        raise NotImplementedError

    def comm_bytes(self) -> tuple[float, dict[str, int]]:
        """Ring-convention bytes and calls per collective since the last reset."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ours(Trainer):
    def __init__(
        self, stage: int, config: GPTConfig, seed: int, hyper: Hyper, comm: zero_comm.Communicator,
        offload: str = "none", checkpoint: str = "none", in_backward: bool = False,
    ) -> None:  # fmt: skip
        self.name = f"ours-{stage}" + ("-det" if comm.deterministic else "")
        tiers: dict[str, Any] = {}
        if in_backward:
            self.name += "-in-bwd"
            tiers = {"optimizer_in_backward": True, "nonfinite": "raise"}
        if offload != "none":
            self.name += f"-{offload}"
            tiers = {"offload_optimizer": offload, "offload_params": offload}
            sub_group = os.environ.get("ZERO_BENCH_SUB_GROUP_NUMEL")
            if sub_group:
                tiers["offload_sub_group_numel"] = int(sub_group)
            if offload == "disk":
                folder = os.environ.get("ZERO_BENCH_OFFLOAD_DIR", tempfile.gettempdir())
                tiers["offload_dir"] = folder
            # tools/offload/bench.py's gradient tier off: gradients kept on the device
            if os.environ.get("ZERO_BENCH_OFFLOAD_GRADIENTS") == "0":
                tiers["offload_gradients"] = False
                self.name += "-grads-on-device"
        self.comm = comm
        init_values = None
        if stage >= 1:  # built on the meta device, as zero-train does: set-up holds the
            # stage's own model states and one tensor more, never the whole float32 model
            with torch.device("meta"):
                model = GPT(config, seed=seed)
            init_values = model.initial_values(seed)
        else:
            model = build_gpt(config, seed)
        if checkpoint == "full":
            from zero_models.checkpoint_plan import checkpoint_gpt_blocks

            # contiguous=False: keep each block's input itself, as torch's checkpoint does
            # for the peers (the arena, M_D, would add one pre-allocated copy per block)
            checkpoint_gpt_blocks(model, "full", None, contiguous=False)
        self.engine = zero_core.initialize(
            model,
            lambda params: hyper.adamw(params),
            zero_core.ZeroConfig(
                stage=stage,
                # tools/offload/bench.py sets its own for both of its variants
                bucket_numel=int(os.environ.get("ZERO_BENCH_BUCKET_NUMEL", BUCKET_NUMEL)),
                prefetch_numel=int(
                    os.environ.get(
                        "ZERO_BENCH_PREFETCH_NUMEL",
                        zero_core.config.zero_config.DEFAULT_PREFETCH_NUMEL,
                    )
                ),
                **tiers,
            ),
            comm,
            init_values=init_values,
        )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.engine(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        if not self.engine.step():
            raise RuntimeError(f"[rank {self.comm.rank}] {self.name}: step() was skipped")

    def state_bytes(self) -> StateBytes:
        report = self.engine.memory_report()
        return StateBytes(
            report.parameters,
            report.gradients,
            report.master_weights + report.optimizer_states,
            report.buffers + report.comm_buffers,
            report.host,
            report.disk,
        )

    def comm_bytes_reset(self) -> None:
        self.comm.stats.reset()

    def disk_counters(self) -> list[Any]:
        """The engine's swap-file counters: the optimizer's pipeline (masters, states and
        offloaded gradients) and the parameter shards' reads; none without a disk tier."""
        swap = getattr(self.engine.masters, "swap", None)
        store = getattr(self.engine.compute_params, "store", None)
        return [c for c in (swap, store) if c is not None and hasattr(c, "bytes_read")]

    def disk_bytes_reset(self) -> None:
        for counter in self.disk_counters():
            counter.bytes_read = 0
            if hasattr(counter, "bytes_written"):
                counter.bytes_written = 0

    def disk_bytes(self) -> dict[str, int]:
        """Bytes read from and written to swap files since :meth:`disk_bytes_reset`
        (the parameter shards' writes after the step have no counter in the engine)."""
        counters = self.disk_counters()
        return {
            "read": sum(int(c.bytes_read) for c in counters),
            "written": sum(int(getattr(c, "bytes_written", 0)) for c in counters),
        }

    def comm_bytes(self) -> tuple[float, dict[str, int]]:
        counts = self.comm.stats.as_dict()
        calls = {op: int(c["calls"]) for op, c in counts.items() if c["calls"] and op != "barrier"}
        return float(sum(c["volume_bytes"] for c in counts.values())), calls

    def close(self) -> None:
        self.engine.close()  # removes swap files now, not when collected
        del self.engine


class TorchPeer(Trainer):
    """DDP, ZeroRedundancyOptimizer + DDP, or FSDP2 on a torch process group."""

    def __init__(
        self, name: str, config: GPTConfig, seed: int, hyper: Hyper, group: Any,
        checkpoint: str = "none",
    ) -> None:  # fmt: skip
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name = name
        self.counter = comm_hooks.CallCounter(group)
        model: nn.Module
        self.optimizer: Any
        if name in ("fsdp2", "fsdp2-in-bwd"):
            model = fsdp2_gpt(config, seed, group, checkpoint)
            self.module = model
            if name == "fsdp2":
                self.optimizer = hyper.adamw(model.parameters())
            else:
                self.optimizer = StepsInBackward(model.parameters(), hyper)
            self.local_optimizer = self.optimizer
        else:
            self.module = build_gpt(config, seed)
            if checkpoint == "full":
                checkpoint_blocks_with_torch(self.module)
            ddp = DDP(self.module, process_group=group, gradient_as_bucket_view=True)
            # The same all-reduce as DDP's built-in one, through Python so comm_hooks sees it.
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
            model = ddp
            if name == "ddp":
                self.optimizer = hyper.adamw(ddp.parameters())
                self.local_optimizer = self.optimizer
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                zro = ZeroRedundancyOptimizer(
                    ddp.parameters(),
                    optimizer_class=torch.optim.AdamW,
                    process_group=group,
                    lr=hyper.lr,
                    betas=hyper.betas,
                    weight_decay=hyper.weight_decay,
                )
                self.optimizer = zro
                self.local_optimizer = zro.optim
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.counter:
            return next_token_loss(self.model(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        with self.counter:
            torch.autograd.backward(loss)

    def optimizer_step(self) -> None:
        with self.counter:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> StateBytes:
        params = storages(self.module.parameters())
        grads = storages(p.grad for p in self.module.parameters())
        states = storages(optimizer_tensors(self.local_optimizer))
        return StateBytes(sum(params.values()), sum(grads.values()), sum(states.values()), 0)

    def comm_bytes_reset(self) -> None:
        self.counter.reset()

    def comm_bytes(self) -> tuple[float, dict[str, int]]:
        return self.counter.total_bytes, dict(self.counter.calls)

    def close(self) -> None:
        if isinstance(self.optimizer, StepsInBackward):
            self.optimizer.close()
        del self.optimizer, self.local_optimizer, self.model, self.module


class StepsInBackward:
    """One AdamW per parameter, stepped by the parameter's post-accumulate-grad hook, its
    gradient freed right after (torch's "optimizer step in backward" recipe; FSDP2 runs the
    hook on each sharded parameter once its reduce-scatter has landed). ``step`` and
    ``zero_grad`` have nothing left to do; ``state`` is every optimizer's state."""

    def __init__(self, params: Iterable[nn.Parameter], hyper: Hyper) -> None:
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self.handles: list[Any] = []
        for param in params:
            self.optimizers[param] = hyper.adamw([param])
            self.handles.append(param.register_post_accumulate_grad_hook(self._step))

    def _step(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]  # type: ignore[index]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers.values() for k, v in o.state.items()}

    def step(self) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def close(self) -> None:
        """Remove the hooks: each holds this object, and through it every optimizer and
        parameter, alive for as long as the model lives (the next variant's run)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.optimizers = [], {}


def fsdp2_gpt(config: GPTConfig, seed: int, group: Any, checkpoint: str = "none") -> nn.Module:
    """:func:`fsdp2_gpt_on_mesh` on a 1-D mesh of ``group``'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device_type="cpu")
    return fsdp2_gpt_on_mesh(config, seed, mesh, checkpoint)


def fsdp2_gpt_on_mesh(
    config: GPTConfig, seed: int, mesh: Any, checkpoint: str = "none", mp_policy: Any = None
) -> nn.Module:
    """``fully_shard`` on each block and the root of a GPT built on the meta device, then each
    parameter's shard filled from ``GPT.initial_values`` (one full tensor at a time), so that,
    like our stage 3, no rank holds the whole model. ``mesh``: 1-D (FSDP) or 2-D
    (replicate, shard: HSDP); ``mp_policy``: a MixedPrecisionPolicy for ``fully_shard``, or
    None to pass none (FSDP2's default)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    with torch.device("meta"):
        model = GPT(config, seed=seed)
    values = model.initial_values(seed)
    if checkpoint == "full":
        checkpoint_blocks_with_torch(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values:
            param = params[name]
            shard = distribute_tensor(value, param.device_mesh, param.placements)  # type: ignore[attr-defined]
            local(param).copy_(shard.to_local())
    return model


class DeepSpeedPeer(Trainer):
    """DeepSpeed's ZeRO stage 1, 2 or 3 on the world (it clones the world group itself)."""

    def __init__(
        self, stage: int, config: GPTConfig, seed: int, hyper: Hyper, batch: int,
        offload: bool = False, checkpoint: str = "none",
    ) -> None:  # fmt: skip
        deepspeed = importlib.import_module("deepspeed")
        self.name = f"deepspeed-{stage}" + ("-cpu" if offload else "")
        self.counter = comm_hooks.CallCounter(comm_hooks.ANY_GROUP)
        self.module = build_gpt(config, seed)
        if checkpoint == "full":
            checkpoint_blocks_with_torch(self.module)
        zero: dict[str, Any] = {
            "stage": stage,
            "reduce_bucket_size": BUCKET_NUMEL,
            "allgather_bucket_size": BUCKET_NUMEL,
        }
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = BUCKET_NUMEL
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            zero["offload_param"] = {"device": "cpu"}
        ds_config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # its default is 1.0: the others do not clip
            "steps_per_print": 2**30,
            "wall_clock_breakdown": False,
            "zero_force_ds_cpu_optimizer": False,  # the same torch AdamW as the others
        }
        with self.counter:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=self.module, optimizer=hyper.adamw(self.module.parameters()), config=ds_config
            )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.counter:
            return next_token_loss(self.engine(inputs), targets)

    def backward(self, loss: torch.Tensor) -> None:
        with self.counter:
            self.engine.backward(loss)

    def optimizer_step(self) -> None:
        with self.counter:
            self.engine.step()

    def state_bytes(self) -> StateBytes:
        params_list = list(self.module.parameters())
        params = storages(params_list)
        params.update(storages(getattr(p, "ds_tensor", None) for p in params_list))
        grads = storages(p.grad for p in params_list)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        states = storages(optimizer_tensors(inner))
        masters = storages(
            t
            for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
            for t in getattr(self.optimizer, attr, [])
        )
        for key in masters:
            params.pop(key, None)
        states.update(masters)
        counted = params.keys() | grads.keys() | states.keys()
        other = {
            k: v for k, v in storages(reachable_tensors(self.optimizer)).items() if k not in counted
        }
        return StateBytes(
            sum(params.values()), sum(grads.values()), sum(states.values()), sum(other.values())
        )

    def comm_bytes_reset(self) -> None:
        self.counter.reset()

    def comm_bytes(self) -> tuple[float, dict[str, int]]:
        return self.counter.total_bytes, dict(self.counter.calls)

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        del self.engine, self.optimizer, self.module


def make_trainer(
    variant: str,
    config: GPTConfig,
    seed: int,
    hyper: Hyper,
    comm: zero_comm.Communicator,
    batch: int,
    checkpoint: str = "none",
) -> Trainer:
    """``variant`` on ``comm`` (a communicator of its own, deterministic for ``-det``;
    DeepSpeed ignores it), its blocks checkpointed with ``checkpoint="full"``."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint {checkpoint!r}: choose from {', '.join(CHECKPOINT_MODES)}")
    if variant in OURS or variant in OURS_DET:
        return Ours(int(variant.split("-")[1]), config, seed, hyper, comm, checkpoint=checkpoint)
    if variant in OURS_OFFLOAD:
        return Ours(
            3, config, seed, hyper, comm, offload=variant.split("-")[2], checkpoint=checkpoint
        )
    if variant == "ours-3-in-bwd":
        return Ours(3, config, seed, hyper, comm, checkpoint=checkpoint, in_backward=True)
    if variant in TORCH_PEERS or variant == "fsdp2-in-bwd":
        group = getattr(comm, "group", None)
        return TorchPeer(variant, config, seed, hyper, group, checkpoint)
    if variant in DEEPSPEED:
        return DeepSpeedPeer(int(variant[-1]), config, seed, hyper, batch, checkpoint=checkpoint)
    if variant in DEEPSPEED_OFFLOAD:
        return DeepSpeedPeer(3, config, seed, hyper, batch, offload=True, checkpoint=checkpoint)
    raise ValueError(f"variant {variant!r}: choose from {', '.join(VARIANTS)}")
