"""``ZeroStrategy``: Lightning's Trainer over zero_core's engine.

    trainer = lightning.Trainer(accelerator="cpu", devices=2, precision="bf16-mixed",
                                strategy=ZeroStrategy(stage=3))
    trainer.fit(module)

Processes come as with Lightning's DDP strategy, which this one extends: Lightning's own
launcher (``devices=N``), torchrun, SLURM. Lightning initialises the process group; the
strategy adopts it as a deterministic zero_comm communicator, so every stage gives the
same bits. In ``setup`` the module and the optimizer from ``configure_optimizers`` become
one engine (``strategy.engine``); the optimizer the module returned fronts the engine's
(zero_core.user_optimizer), so its schedulers drive the engine's learning rate. The
Trainer's backward, step and clipping reach the engine through ZeroPrecision;
checkpoints are the engine's sharded folders (``path/<tag>/`` and ``path/latest``),
with Lightning's own state inside (zero_core.lightning.trainer_state).

Hooks taken over from DDPStrategy, and why:

    setup_environment   + adopt Lightning's process group as the communicator
    setup               the engine instead of DDP; no module move for a meta-device model
    precision_plugin    the Trainer's is replaced by ZeroPrecision (its name is checked)
    save/load_checkpoint, lightning_module_state_dict, optimizer_state,
    load_model_state_dict, load_optimizer_state_dict   the engine's save and load
    restore_checkpoint_after_setup   True: the engine must exist to load into
    teardown            leaves the module where the engine keeps it (no .cpu())
    _layer_sync         Trainer(sync_batchnorm=True) is refused, not ignored
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

import zero_comm
from zero_comm import Communicator

from ..config.zero_config import ZeroConfig
from ..engine import Engine
from ..init_values import values_from_reset_parameters
from ..initialize import initialize
from . import trainer_state
from .precision import ZeroPrecision
from .settings import StrategySettings, check_precision

# The names a Trainer accepts as strategy="..." once zero_core.lightning is imported.
REGISTERED: dict[str, dict[str, Any]] = {
    **{f"zero_stage_{stage}": {"stage": stage} for stage in (0, 1, 2, 3)},
    "zero": {},
}


class ZeroStrategy(DDPStrategy):
    """Train with zero_core's engine under Lightning's Trainer.

    Args:
        stage, **fields: ZeroConfig's fields (``ZeroStrategy(stage=3, bucket_numel=...)``).
        config: a whole ZeroConfig instead.
        deepspeed: a DeepSpeed config (a dict or a JSON file's path) instead, read by
            zero_core.read_deepspeed; its optimizer and scheduler sections are refused
            (they belong in ``configure_optimizers``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        process_group_backend, timeout, start_method: as for Lightning's DDPStrategy
            (``timeout`` None: its default).

    The Trainer's ``precision`` ('32-true', 'bf16-mixed', '16-mixed') sets ``param_dtype``,
    its ``accumulate_grad_batches`` the engine's ``gradient_accumulation_steps``, and its
    ``gradient_clip_val`` clips by the global norm (``engine.clip_grad_norm_``); a setting
    given both ways and differently is an error naming both.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int | None = None,
        *,
        config: ZeroConfig | None = None,
        deepspeed: Any = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **fields: Any,
    ) -> None:
        if stage is not None:
            fields["stage"] = stage
        self.settings = StrategySettings(fields, config, deepspeed)
        self.engine: Engine | None = None
        self.comm: Communicator | None = None
        ddp_options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **ddp_options,
        )

    # ------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> ZeroPrecision:
        if not isinstance(self._precision_plugin, ZeroPrecision):
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """The Trainer's plugin is replaced by a ZeroPrecision of the same name, once the
        name is one the engine honours (ValueError naming the supported ones)."""
        if plugin is None or isinstance(plugin, ZeroPrecision):
            self._precision_plugin = plugin
            return
        name = str(getattr(plugin, "precision", "32-true"))
        if type(plugin) is not Precision and name == "32-true":
            raise ValueError(
                f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__}: give "
                "Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed') instead"
            )
        check_precision(name)
        self._precision_plugin = ZeroPrecision(name)

    # ------------------------------------------------------------ refused
    @property
    def _layer_sync(self) -> None:
        return None

    @_layer_sync.setter
    def _layer_sync(self, layer_sync: Any) -> None:
        """Trainer(sync_batchnorm=True) is refused: DDPStrategy's setup converts the
        BatchNorm layers, which this strategy's setup does not do; ignoring the flag
        would train with per-rank statistics without a word."""
        if layer_sync is not None:
            raise ValueError(
                "ZeroStrategy does not support Trainer(sync_batchnorm=True) (or a LayerSync "
                "plugin): convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm "
                "before fit, or leave BatchNorm per rank"
            )

    # ------------------------------------------------------------ processes
    def setup_environment(self) -> None:
        """Lightning's process group (DDPStrategy), adopted as a deterministic communicator
        (collective; once per strategy: a second fit or a validate reuses it)."""
        super().setup_environment()
        if self.comm is None:
            if self._timeout is None:
                self.comm = zero_comm.from_process_group(None, deterministic=True)
            else:
                seconds = self._timeout.total_seconds()
                self.comm = zero_comm.from_process_group(None, deterministic=True, timeout=seconds)

    # ------------------------------------------------------------ the engine
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer, module)
        elif self._engine_of(module) is not None:
            # validate/test/predict after fit: the trained engine. Lightning only calls
            # its model (and compares it with the module), so the engine serves as one.
            self.model = self.engine  # type: ignore[assignment]
        else:
            self._check_whole(module)
            self.model_to_device()
            _sync_module_states(module)  # as DDPStrategy: rank 0's values everywhere
        self.setup_precision_plugin()

    def _engine_of(self, module: nn.Module) -> Engine | None:
        engine = self.engine
        return (
            engine if engine is not None and engine.module is module and not engine.closed else None
        )

    def _build_engine(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self._engine_of(module) is not None:
            raise RuntimeError(
                "ZeroStrategy: a second fit of a module this strategy already trained; "
                "give each Trainer a ZeroStrategy() of its own (its engine is a new one)"
            )
        assert self.comm is not None
        meta = any(p.is_meta for p in module.parameters())
        if not meta:
            self.model_to_device()
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeroStrategy trains with one optimizer; configure_optimizers returned "
                f"{len(optimizers)}"
            )
        config = self.settings.resolve(
            world_size=self.world_size,
            precision=self.precision_plugin.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
        )
        init_values = values_from_reset_parameters(module, self.root_device) if meta else None
        self.engine = initialize(module, optimizers[0], config, self.comm, init_values=init_values)
        self.precision_plugin.engine = self.engine
        # Lightning calls its model (training_step goes through it), as DeepSpeed's engine.
        self.model = self.engine  # type: ignore[assignment]
        self.optimizers = optimizers
        self.lr_scheduler_configs = scheduler_configs

    def _check_whole(self, module: nn.Module) -> None:
        if any(p.is_meta for p in module.parameters()):
            raise RuntimeError(
                "ZeroStrategy: validate/test/predict of a model on the meta device without a "
                "fit: run trainer.fit first (the engine gives it its values), or build it whole"
            )

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    @property
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning calls backward per micro-batch and the step at the boundary;
        the engine's gradient_accumulation_steps is accumulate_grad_batches."""
        return False

    # ------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the engine saves the model (sharded); the module's own state_dict()
        would be the placeholders at stage 3."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Empty: the engine saves the optimizer states (sharded)."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Collective: the engine's sharded checkpoint in the folder ``filepath``
        (``filepath/<tag>/`` and ``filepath/latest``), Lightning's state inside it."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy: save_checkpoint(storage_options=...) is not supported; the "
                "engine writes its own files"
            )
        engine = self._require_engine("trainer.save_checkpoint")
        path = self.broadcast(str(filepath))
        engine.save(path, trainer_state.to_extra(checkpoint))

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Collective: the engine loads the model and optimizer states saved at
        ``checkpoint_path`` (by any world size and stage); returns Lightning's state."""
        engine = self._require_engine("ckpt_path=")
        path = self.broadcast(str(checkpoint_path))
        return trainer_state.from_extra(engine.load(path), path)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: load_checkpoint's engine.load restored the model."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: load_checkpoint's engine.load restored the optimizer states."""

    def _require_engine(self, what: str) -> Engine:
        if self.engine is None:
            raise RuntimeError(
                f"ZeroStrategy: {what} needs the engine, which trainer.fit builds; "
                "call it during or after fit"
            )
        return self.engine

    # ------------------------------------------------------------ the end
    def teardown(self) -> None:
        """As Lightning's, without moving the module to the CPU: its parameters are the
        engine's (on a GPU, ``.cpu()`` would detach them; zero_core.module_guard)."""
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``strategy="zero_stage_3"`` etc. (registered when zero_core.lightning is imported)."""
        for name, init_params in REGISTERED.items():
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"zero_core's engine ({name})", **init_params
                )
