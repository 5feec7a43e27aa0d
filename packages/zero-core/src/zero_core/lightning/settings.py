"""What a ``ZeroStrategy`` was asked for, resolved against the Trainer into one ZeroConfig.

A strategy is given its ZeRO settings one of three ways, exactly one at a time::

    ZeroStrategy(stage=3, bucket_numel=2**20)          # ZeroConfig's fields
    ZeroStrategy(config=ZeroConfig(stage=3))           # a ZeroConfig
    ZeroStrategy(deepspeed="ds_config.json")           # a DeepSpeed config (file or dict)

and the Trainer brings three more: ``precision``, ``accumulate_grad_batches`` and
``gradient_clip_val``. Each of those has one owner: where the strategy's settings and the
Trainer's disagree, the error names both and the one to keep, instead of one of them
winning silently.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config.deepspeed_json import read_deepspeed
from ..config.zero_config import ZeroConfig

# Lightning's precision names the engine honours, and the compute dtype each means. Ours
# is DeepSpeed's reading of "mixed": the parameters the model computes with are bf16/fp16,
# the master weights and optimizer states float32 (not torch.autocast over float32
# parameters, as Lightning's own MixedPrecision plugin does).
PRECISIONS: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}
# Why the others are refused, with what to use instead.
REFUSED_PRECISIONS = {
    "bf16-true": "the engine keeps float32 master weights; use precision='bf16-mixed'",
    "16-true": "the engine keeps float32 master weights; use precision='16-mixed'",
    "64-true": "the engine computes in float32, bfloat16 or float16 only",
    "transformer-engine": "Transformer Engine's fp8 layers are not supported",
    "transformer-engine-float16": "Transformer Engine's fp8 layers are not supported",
}


def check_precision(precision: str) -> torch.dtype:
    """The compute dtype for Lightning's ``precision`` name; ValueError naming the
    precisions that are supported where it is not one of them."""
    if precision in PRECISIONS:
        return PRECISIONS[precision]
    why = REFUSED_PRECISIONS.get(precision, "it is not one the engine knows")
    raise ValueError(
        f"ZeroStrategy cannot honour Trainer(precision={precision!r}): {why}. Supported: "
        f"{', '.join(repr(p) for p in PRECISIONS)}"
    )


@dataclasses.dataclass(frozen=True)
class StrategySettings:
    """The strategy's own ZeRO settings, before the Trainer's are known.

    ``fields`` are ZeroConfig's (checked now: a misspelt field fails at construction);
    ``config`` a whole ZeroConfig; ``deepspeed`` a DeepSpeed config, read once the world
    size is known (its batch arithmetic needs it)."""

    fields: Mapping[str, Any]
    config: ZeroConfig | None
    deepspeed: Mapping[str, Any] | str | os.PathLike[str] | None

    def __post_init__(self) -> None:
        given = [
            name
            for name, present in (
                ("ZeroConfig fields", bool(self.fields)),
                ("config=", self.config is not None),
                ("deepspeed=", self.deepspeed is not None),
            )
            if present
        ]
        if len(given) > 1:
            raise ValueError(
                f"ZeroStrategy got {' and '.join(given)}: give the settings one way, e.g. "
                "ZeroStrategy(stage=3, ...) or ZeroStrategy(config=ZeroConfig(stage=3, ...))"
            )
        if self.config is not None and not isinstance(self.config, ZeroConfig):
            raise TypeError(
                f"ZeroStrategy(config=...) takes a zero_core.ZeroConfig, got "
                f"{type(self.config).__name__}; a DeepSpeed dict goes to deepspeed="
            )
        names = {f.name for f in dataclasses.fields(ZeroConfig)}
        unknown = sorted(set(self.fields) - names)
        if unknown:
            raise TypeError(
                f"ZeroStrategy got {', '.join(unknown)}: not ZeroConfig fields (see "
                "help(zero_core.ZeroConfig)); Lightning's own settings go to the Trainer"
            )
        if self.fields:
            # every other check of the fields, now
            refuse_micro_batch_slots(ZeroConfig(**self.fields))
        if self.config is not None:
            refuse_micro_batch_slots(self.config)

    def resolve(
        self,
        *,
        world_size: int,
        precision: str,
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
    ) -> ZeroConfig:
        """The engine's ZeroConfig: the strategy's settings with the Trainer's precision
        and accumulation; ValueError naming both where they disagree."""
        if self.deepspeed is not None:
            setup = read_deepspeed(self.deepspeed, world_size=world_size)
            for section, present in (
                ("optimizer", setup.optimizer),
                ("scheduler", setup.scheduler),
            ):
                if present is not None:
                    raise ValueError(
                        f"ZeroStrategy(deepspeed=...): the config's {section!r} section is not "
                        "used under Lightning; return the optimizer and scheduler from "
                        "LightningModule.configure_optimizers and remove the section"
                    )
            config = setup.zero
        elif self.config is not None:
            config = self.config
        else:
            config = ZeroConfig(**self.fields)
        return _with_trainer(config, precision, accumulate_grad_batches, gradient_clip_val)


def refuse_micro_batch_slots(config: ZeroConfig) -> None:
    """ValueError if ``config`` gives a rank more than one micro-batch slot.

    Lightning's loop gives every rank the same batches (DistributedSampler) and calls
    backward once per batch, stepping every ``accumulate_grad_batches`` batches on every
    rank alike; rank i of ``micro_batches_per_rank`` needs c_i backward calls per
    micro-step, each on a batch of its own. Run as is, the ranks would meet in different
    collectives (a hang, or another update), so it is refused. ``shard_weights`` is the
    engine's layout alone and is honoured; all-ones counts are the homogeneous run."""
    counts = config.micro_batches_per_rank
    if counts is None or (counts != "auto" and all(c == 1 for c in counts)):
        return
    given = counts if counts == "auto" else list(counts)
    raise ValueError(
        f"ZeroStrategy cannot run micro_batches_per_rank={given!r}: Lightning gives every "
        "rank the same batches and one backward per batch, but rank i must run c_i "
        "backward calls (each on its own batch) per micro-step. Remove "
        "micro_batches_per_rank (shard_weights is supported under Lightning), or train "
        "with zero-train --micro-batches-per-rank, or with your own loop calling "
        "engine.backward c_i times per micro-step (docs/mixed-hardware.md)"
    )


def _with_trainer(
    config: ZeroConfig, precision: str, accumulate: int, clip: float | None
) -> ZeroConfig:
    refuse_micro_batch_slots(config)
    dtype = check_precision(precision)
    changes: dict[str, Any] = {}
    if dtype is not torch.float32:
        if config.param_dtype not in (torch.float32, dtype):
            raise ValueError(
                f"Trainer(precision={precision!r}) and the strategy's param_dtype="
                f"{config.param_dtype} disagree: set one of them"
            )
        changes["param_dtype"] = dtype
    if config.gradient_accumulation_steps not in (1, accumulate):
        raise ValueError(
            f"the strategy's gradient_accumulation_steps={config.gradient_accumulation_steps} "
            f"and Trainer(accumulate_grad_batches={accumulate}) disagree: set "
            "accumulate_grad_batches on the Trainer only"
        )
    changes["gradient_accumulation_steps"] = accumulate
    if clip and config.clip_grad_norm is not None:
        raise ValueError(
            f"Trainer(gradient_clip_val={clip}) and the strategy's clip_grad_norm="
            f"{config.clip_grad_norm} would both clip: set gradient_clip_val on the Trainer only"
        )
    return dataclasses.replace(config, **changes)
