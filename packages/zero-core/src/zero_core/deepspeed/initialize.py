"""``initialize``: DeepSpeed's entry point over ``zero_core.initialize``.

    engine, optimizer, loader, scheduler = zero_core.deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        training_data=dataset, config="ds_config.json")

Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as DeepSpeed does: the
:class:`~zero_core.deepspeed.engine.DeepSpeedEngine`, the optimizer it steps
(``engine.optimizer``: over its float32 master weights), the training data split over
the data-parallel ranks (or None), and the scheduler it steps after every applied update
(or None). What cannot be honoured (``mpu``, ``mesh_param``, a feature section of the
config, ...) is refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zero_comm import Communicator

from ..config.deepspeed_json import DeepSpeedSetup, read_deepspeed
from ..engine import Engine
from ..initialize import initialize as core_initialize
from ..optimizer_spec import OptimizerSpec
from .config_source import config_dict, split_facade_keys
from .dataloader import distributed_loader
from .distributed import DEFAULT_PORT, WORLD, init_distributed
from .engine import DeepSpeedEngine
from .param_status import mark_partitioned
from .unsupported import refuse_unless_default


class Initialized(NamedTuple):
    """What ``initialize`` returns; unpacks as DeepSpeed's 4-tuple."""

    engine: DeepSpeedEngine
    optimizer: torch.optim.Optimizer
    training_dataloader: DataLoader[Any] | None
    lr_scheduler: Any


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: OptimizerSpec | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    comm: Communicator | None = None,
) -> Initialized:
    """DeepSpeed's ``initialize`` (module doc).

    Args:
        args: a namespace whose ``deepspeed_config`` names the config file (when
            ``config`` is not given).
        model: the ``nn.Module``; moved to the communicator's device if it is elsewhere,
            as DeepSpeed moves it.
        optimizer: a torch optimizer built over the model's parameters, an optimizer
            class or a callable ``params -> optimizer`` (called with ``model_parameters``),
            or None with an ``optimizer`` section in the config.
        model_parameters: the parameters or parameter groups the optimizer is built over.
        training_data: a ``Dataset``: the returned dataloader splits it over the ranks.
        lr_scheduler: a scheduler object over the returned optimizer, or a callable
            ``optimizer -> scheduler``; the engine steps it after every applied update.
            Not with a ``scheduler`` section in the config (DeepSpeed would drop one of
            them silently).
        collate_fn: the dataloader's.
        config, config_params: the DeepSpeed config (a dict or a JSON file's path).
        dist_init_required: accepted, no effect (the communicator is made if none is).
        comm: zero_core's own: the communicator to train over (default: the one
            ``init_distributed`` made, made now if there is none).
    """
    refuse_unless_default(
        "initialize",
        {
            "mpu": (mpu, None, "pass a zero_core.ModelParallel to zero_core.initialize"),
            "mesh_param": (mesh_param, None, "zero_core has one data-parallel dimension"),
            "distributed_port": (distributed_port, DEFAULT_PORT, "set MASTER_PORT instead"),
        },
    )
    if model is None:
        raise ValueError("initialize needs model=: the nn.Module to train")
    engine_config, own, notes = split_facade_keys(config_dict(args, config, config_params))
    if comm is None:
        comm = WORLD.comm if WORLD.comm is not None else init_distributed()
    setup = read_deepspeed(engine_config, world_size=comm.world_size)
    if setup.scheduler is not None and lr_scheduler is not None:
        raise ValueError(
            "initialize was given lr_scheduler= and the config has a 'scheduler' section: "
            "use one of them (DeepSpeed would ignore the config's)"
        )
    spec, setup = _optimizer_spec(optimizer, model_parameters, setup)
    _to_device(model, comm)
    core = core_initialize(model, spec, setup, comm)
    _attach_scheduler(core, lr_scheduler)
    if core.config.stage == 3:
        mark_partitioned(core)
    if notes and comm.rank == 0:
        warnings.warn("DeepSpeed config: " + "; ".join(notes), stacklevel=2)
    loader = None
    if training_data is not None:
        drop_last = bool(own.get("dataloader_drop_last", False))
        loader = distributed_loader(
            training_data, comm, setup.micro_batch_size, collate_fn, drop_last
        )
    engine = DeepSpeedEngine(core, setup.micro_batch_size)
    return Initialized(engine, core.optimizer, loader, core.lr_scheduler)


def _optimizer_spec(
    optimizer: OptimizerSpec | None, model_parameters: Iterable[Any] | None, setup: DeepSpeedSetup
) -> tuple[OptimizerSpec | None, DeepSpeedSetup]:
    """What zero_core.initialize is given as the optimizer, and the setup it reads: with
    ``model_parameters``, the optimizer (the config's, or a class/callable) is built over
    them, as DeepSpeed builds it, so their groups and options are kept."""
    if model_parameters is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, setup
    params = list(model_parameters)  # a generator is read once, by the factory below
    if optimizer is None and setup.optimizer is not None:
        chosen, options = setup.optimizer
        return (lambda _: chosen(params, **options)), dataclasses.replace(setup, optimizer=None)
    if optimizer is not None:
        build = cast(Callable[[list[Any]], torch.optim.Optimizer], optimizer)
        return (lambda _: build(params)), setup
    return None, setup


def _to_device(model: nn.Module, comm: Communicator) -> None:
    """Move ``model`` to the communicator's device, as DeepSpeed does; meta-device
    parameters stay (zero_core.initialize names them)."""
    if any(p.device != comm.device and not p.is_meta for p in model.parameters()):
        model.to(comm.device)


def _attach_scheduler(core: Engine, scheduler: Any) -> None:
    """Make ``scheduler`` (an object, or a callable of the engine's optimizer) the one
    the engine steps after every applied update."""
    if scheduler is None:
        return
    if not hasattr(scheduler, "step") and callable(scheduler):
        scheduler = scheduler(core.optimizer)
    target = getattr(scheduler, "optimizer", None)
    # An optimizer the user passed fronts the engine's (same param_groups): a scheduler
    # built on it before initialize drives the engine (zero_core.user_optimizer).
    fronted = getattr(target, "param_groups", None) is core.optimizer.param_groups
    if target is not None and target is not core.optimizer and not fronted:
        raise ValueError(
            f"lr_scheduler {type(scheduler).__name__} was built on another optimizer than "
            "the one the engine steps, so it would not change the learning rate: pass "
            "lr_scheduler=lambda optimizer: YourScheduler(optimizer, ...) (called with "
            "engine.optimizer)"
        )
    core.lr_scheduler = scheduler
