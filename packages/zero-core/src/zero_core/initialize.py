"""``initialize``: a model, an optimizer, a config and a communicator, to an Engine."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zero_comm import Communicator

from . import accelerate_guard, module_guard, param_owner, user_optimizer
from .builder import build_engine_parts
from .config.deepspeed_json import DeepSpeedSetup, read_deepspeed
from .config.zero_config import ZeroConfig
from .engine import Engine
from .init_values import InitValues
from .memory.build_heap import large_blocks_mapped
from .model_parallel import ModelParallel
from .optimizer_spec import OptimizerSpec, resolve_param_groups
from .stage0 import POLICY as STAGE0
from .stage1 import POLICY as STAGE1
from .stage2 import POLICY as STAGE2
from .stage3 import POLICY as STAGE3
from .stage_policy import StagePolicy

POLICIES: dict[int, StagePolicy] = {0: STAGE0, 1: STAGE1, 2: STAGE2, 3: STAGE3}


def initialize(
    model: nn.Module,
    optimizer: OptimizerSpec | None = None,
    config: ZeroConfig | DeepSpeedSetup | Mapping[str, Any] | None = None,
    comm: Communicator | None = None,
    *,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    model_parallel: ModelParallel | None = None,
    init_values: InitValues | None = None,
) -> Engine:
    """Wrap ``model`` for ZeRO training on the ranks of ``comm``.

    Args:
        model: an ``nn.Module`` on ``comm.device``; rank 0's initial values are broadcast.
        optimizer: an optimizer built over ``model.parameters()`` (its groups and options
            are kept), an optimizer class (with ``optimizer_kwargs``), or a factory
            ``params -> Optimizer``. It must be elementwise (SGD, Adam, AdamW, ...). The
            engine builds its own optimizer of that class over its master weights
            (``engine.optimizer``). An instance passed here then fronts it
            (zero_core.user_optimizer): its ``param_groups`` are the engine optimizer's,
            so a learning-rate scheduler built on it, before or after, drives the engine;
            its ``step()`` raises, naming ``engine.step()``.
        config: a :class:`ZeroConfig`, or a whole DeepSpeed config (a dict, or
            ``read_deepspeed``'s result). A DeepSpeed config's optimizer section builds the
            optimizer when ``optimizer`` is None (as ``deepspeed.initialize`` does), and its
            scheduler becomes ``engine.lr_scheduler``, stepped by every applied step.
        comm: the data-parallel communicator; ``deterministic=True`` makes every stage
            equal stage 0 bit for bit.
        model_parallel: with tensor parallelism, the tensor-parallel group and the
            parameters split over it (for the global gradient norm and float16 overflow).
        init_values: ``(name, tensor)`` pairs (or a state dict) that give the parameters
            their initial values, for a model built on the meta device: stage 3 shards
            each one as it arrives, so no rank holds the whole model. Rank 0's values are
            broadcast, as with a model built whole.
    """
    if comm is None:
        raise TypeError("initialize needs comm=: the communicator (zero_comm.init(...))")
    setup = None
    if isinstance(config, DeepSpeedSetup):
        setup = config
    elif config is None or not isinstance(config, ZeroConfig):
        setup = read_deepspeed(config or {}, world_size=comm.world_size)
    if setup is not None:
        config, optimizer, optimizer_kwargs = _from_deepspeed(setup, optimizer, optimizer_kwargs)
    assert isinstance(config, ZeroConfig)
    if optimizer is None:
        raise TypeError(
            "initialize needs an optimizer: pass one, or a DeepSpeed config with an "
            "'optimizer' section"
        )
    check_model(model, comm, values_given=init_values is not None)
    groups = resolve_param_groups(
        model, optimizer, optimizer_kwargs, allow_untested=config.allow_untested_optimizer
    )
    policy = POLICIES[config.stage]
    # The build's whole values mapped, not carved from the heap (memory.build_heap)
    host = comm.device.type == "cpu" or bool(config.offloads)
    with large_blocks_mapped(config.release_host_heap and host):
        parts = build_engine_parts(model, groups, config, comm, policy, model_parallel, init_values)
    engine = Engine(parts)
    param_owner.register(engine)
    module_guard.install()  # .to_empty()/.half()/.cuda() would detach the engine's params
    accelerate_guard.install_if_imported()  # accelerator.prepare(model) would wrap it in DDP
    if config.stage == 3:
        module_guard.guard_state_dict(model)  # a released parameter reads NaN
    if isinstance(optimizer, torch.optim.Optimizer):
        user_optimizer.link(optimizer, engine)  # it now drives engine.optimizer, or raises
    if setup is not None:
        engine.lr_scheduler = setup.build_scheduler(engine.optimizer)
        if setup.no_effect and comm.rank == 0:
            warnings.warn(
                "DeepSpeed config keys accepted without effect: " + "; ".join(setup.no_effect),
                stacklevel=2,
            )
    return engine


def _from_deepspeed(
    setup: DeepSpeedSetup, optimizer: OptimizerSpec | None, kwargs: Mapping[str, Any] | None
) -> tuple[ZeroConfig, OptimizerSpec | None, Mapping[str, Any] | None]:
    if setup.optimizer is None:
        return setup.zero, optimizer, kwargs
    if optimizer is not None:
        raise ValueError(
            "an optimizer was passed and the DeepSpeed config has an 'optimizer' section: "
            "use one of them"
        )
    optimizer_class, options = setup.optimizer
    return setup.zero, optimizer_class, options


def check_model(module: nn.Module, comm: Communicator, *, values_given: bool = False) -> None:
    """Reject what the engine cannot train, naming the parameter and the fix. With
    ``values_given`` (init_values), parameters may be on the meta device."""
    for name, p in module.named_parameters():
        if p.is_meta and not values_given:
            raise ValueError(
                f"[rank {comm.rank}] parameter {name} is on the meta device: pass its values "
                "with initialize(..., init_values=...): for example GPT.initial_values(seed), "
                "a state dict, or zero_core.values_from_reset_parameters(model) (each "
                "submodule's reset_parameters(), as FSDP2's to_empty + reset_parameters)"
            )
        if p.device.type != comm.device.type and not p.is_meta:
            raise ValueError(
                f"[rank {comm.rank}] parameter {name} is on {p.device}, but the {comm.backend} "
                f"communicator works on {comm.device}; move the model with "
                f".to({str(comm.device)!r}) first"
            )
        if p.requires_grad and not p.is_floating_point():
            raise TypeError(f"[rank {comm.rank}] parameter {name} is {p.dtype}: not trainable")
