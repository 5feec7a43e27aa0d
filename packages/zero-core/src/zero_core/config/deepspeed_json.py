"""A whole DeepSpeed config (the JSON people already have, Hugging Face's included):
engine settings, batch sizes, optimizer and learning-rate scheduler.

    setup = zero_core.read_deepspeed("ds_config.json", world_size=comm.world_size,
                                     auto={"optimizer.params.lr": 3e-4})
    engine = zero_core.initialize(model, config=setup, comm=comm)   # builds the optimizer
    # engine.lr_scheduler, if the config has one, is stepped by every applied engine.step()

Batch sizes follow DeepSpeed's rule, with N the data-parallel world size:

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x N

any two of the three determine the third (which must then divide exactly); all three must
agree. ``"auto"`` (Hugging Face's placeholder) takes its value from ``auto``, keyed by the
dotted path ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "bf16.enabled");
an engine size left "auto" means zero_core's default; any other "auto" nothing resolves
is an error naming it. Keys accepted without effect are listed in ``no_effect``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .deepspeed_translation import canonical_deepspeed, translate_deepspeed
from .zero_config import ZeroConfig

# DeepSpeed's optimizer types -> the torch class, and the params it accepts.
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "warmup_type",
                       "total_num_steps", "cos_min_ratio"),
}  # fmt: skip


@dataclass(frozen=True)
class DeepSpeedSetup:
    """What a DeepSpeed config asks for, checked and resolved."""

    zero: ZeroConfig
    micro_batch_size: int | None  # per rank and micro-step; None if the config names none
    train_batch_size: int | None  # per optimizer update, over all data-parallel ranks
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None
    scheduler: tuple[str, dict[str, Any]] | None
    no_effect: tuple[str, ...] = field(default=())

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        """The config's scheduler over ``optimizer`` (the engine's), or None."""
        if self.scheduler is None:
            return None
        kind, params = self.scheduler
        return WarmupSchedule(optimizer, kind, **params)


def read_deepspeed(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    world_size: int,
    auto: Mapping[str, Any] | None = None,
) -> DeepSpeedSetup:
    """Read and check a DeepSpeed config (a dict or a JSON file) for ``world_size``
    data-parallel ranks; ``auto`` resolves its "auto" values (see the module doc)."""
    if not isinstance(config, Mapping):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"DeepSpeed config {config}: {exc}") from exc
        if not isinstance(config, Mapping):
            raise ValueError("a DeepSpeed config must be a JSON object")
    config = canonical_deepspeed(config)  # "bfloat16" is "bf16" before "auto"s resolve
    auto = dict(auto or {})
    resolved = {
        key: value if key in BATCH_KEYS else _resolve_auto(value, auto, key)
        for key, value in config.items()
    }
    micro, total, accumulation = _batch_sizes(_batch_entries(resolved, auto), world_size)
    resolved.pop("gradient_accumulation_steps", None)  # the batch rule's, set below
    settings, notes = translate_deepspeed(resolved)
    if accumulation is not None:
        settings["gradient_accumulation_steps"] = accumulation
    return DeepSpeedSetup(
        zero=ZeroConfig(**settings),
        micro_batch_size=micro,
        train_batch_size=total,
        optimizer=_optimizer(resolved.get("optimizer")),
        scheduler=_scheduler(resolved.get("scheduler")),
        no_effect=tuple(notes),
    )


def _resolve_auto(value: Any, auto: dict[str, Any], path: str) -> Any:
    """``value`` with every "auto" found in ``auto`` (by dotted path) replaced."""
    if isinstance(value, Mapping):
        return {k: _resolve_auto(v, auto, f"{path}.{k}" if path else k) for k, v in value.items()}
    if value == "auto" and path in auto:
        return auto[path]
    return value


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def _batch_entries(config: Mapping[str, Any], auto: Mapping[str, Any]) -> dict[str, Any]:
    """The batch keys the config gives, with its "auto" ones taken from ``auto`` only as
    far as the given ones leave the three undetermined (so a trainer's batch flags never
    contradict what the config fixes)."""
    given = {k: config[k] for k in BATCH_KEYS if config.get(k) not in (None, "auto")}
    for key in BATCH_KEYS:
        if len(given) >= 2 or "train_batch_size" in given:
            break
        if config.get(key) == "auto" and key in auto:
            given[key] = auto[key]
    return given


def _positive_int(path: str, value: Any) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path}={value!r} must be a whole number >= 1")
    return value


def _batch_sizes(config: Mapping[str, Any], world_size: int) -> tuple[int | None, ...]:
    """(micro batch per rank, global batch, accumulation steps) by DeepSpeed's rule."""
    total = _positive_int("train_batch_size", config.get("train_batch_size"))
    micro = _positive_int(
        "train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu")
    )
    steps = _positive_int("gradient_accumulation_steps", config.get("gradient_accumulation_steps"))
    rule = (
        f"train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
        f"x {world_size} ranks"
    )
    if total is not None and micro is not None and steps is not None:
        if total != micro * steps * world_size:
            raise ValueError(
                f"train_batch_size={total} is not {micro} x {steps} x {world_size} = "
                f"{micro * steps * world_size} ({rule}); fix one of them, or leave one out "
                "to have it computed"
            )
    elif total is not None and (micro is not None or steps is not None):
        known = micro if micro is not None else steps
        assert known is not None
        other, remainder = divmod(total, known * world_size)
        if remainder or other < 1:
            raise ValueError(
                f"train_batch_size={total} does not divide into {known} x {world_size} ranks "
                f"({rule}); change train_batch_size"
            )
        micro, steps = (micro, other) if micro is not None else (other, steps)
    elif total is not None:
        micro, remainder = divmod(total, world_size)
        if remainder or micro < 1:
            raise ValueError(
                f"train_batch_size={total} does not divide over {world_size} ranks ({rule})"
            )
        steps = 1
    elif micro is not None:
        steps = steps or 1
        total = micro * steps * world_size
    return micro, total, steps


def _optimizer(entry: Any) -> tuple[type[torch.optim.Optimizer], dict[str, Any]] | None:
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or "type" not in entry:
        raise ValueError(f'optimizer must be {{"type": ..., "params": {{...}}}}, got {entry!r}')
    kind = str(entry["type"]).lower()
    params = dict(entry.get("params", {}))
    if kind in ("adam", "adamw"):
        # DeepSpeed's Adam decouples weight decay (adam_w_mode, default on): torch's AdamW.
        decoupled = kind == "adamw" or params.pop("adam_w_mode", True)
        params.pop("torch_adam", None)  # which implementation: the result is the same
        if params.pop("bias_correction", True) is not True:
            raise ValueError("optimizer.params.bias_correction=false is not supported; remove it")
        chosen: type[torch.optim.Optimizer] = torch.optim.AdamW if decoupled else torch.optim.Adam
        allowed = ADAM_PARAMS
    elif kind == "sgd":
        chosen, allowed = torch.optim.SGD, SGD_PARAMS
    else:
        raise ValueError(
            f"optimizer type {entry['type']!r} is not supported: use Adam, AdamW or SGD, or "
            "leave 'optimizer' out and pass your own to zero_core.initialize"
        )
    for key, value in params.items():
        if key not in allowed:
            raise ValueError(
                f"optimizer.params.{key} is not a parameter of {chosen.__name__}; it takes "
                f"{', '.join(allowed)}"
            )
        if value == "auto":
            raise _unresolved(f"optimizer.params.{key}")
    try:  # the values checked the way the step will use them: by building one
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        chosen([torch.nn.Parameter(torch.zeros(1))], **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"optimizer.params {params}: {chosen.__name__} refuses them ({exc}); write "
            'numbers, e.g. "lr": 3e-4'
        ) from None
    return chosen, params


def _scheduler(entry: Any) -> tuple[str, dict[str, Any]] | None:
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or entry.get("type") not in SCHEDULER_PARAMS:
        kind = entry.get("type") if isinstance(entry, Mapping) else entry
        raise ValueError(
            f"scheduler type {kind!r} is not supported: use one of "
            f"{', '.join(SCHEDULER_PARAMS)}, or leave 'scheduler' out and attach your own to "
            "engine.optimizer"
        )
    kind = entry["type"]
    params = dict(entry.get("params", {}))
    for key, value in params.items():
        if key not in SCHEDULER_PARAMS[kind]:
            raise ValueError(
                f"scheduler.params.{key} is not a parameter of {kind}; it takes "
                f"{', '.join(SCHEDULER_PARAMS[kind])}"
            )
        if value == "auto":
            raise _unresolved(f"scheduler.params.{key}")
    if kind != "WarmupLR" and "total_num_steps" not in params:
        raise ValueError(f"scheduler {kind} needs params.total_num_steps")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(
            f"scheduler.params.warmup_type={params['warmup_type']!r}: 'log' or 'linear'"
        )
    return kind, params


def _unresolved(path: str) -> ValueError:
    return ValueError(
        f"{path} is 'auto' and nothing resolved it: write a value, or pass "
        f"read_deepspeed(..., auto={{{path!r}: value}}) (a trainer's own setting)"
    )


class WarmupSchedule(LRScheduler):
    """DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, step for step: update
    number u (u = 0, 1, ...) runs at iteration k = u - 1, as in DeepSpeed, whose scheduler
    starts at iteration -1 (the minimum: warmup_min_lr, or a ratio of 0 for the cosine)
    and is stepped after each update; iteration k >= 0 is:

        warmup gamma(k) = log(k + 1) / log(W)  ("log")  or  k / W  ("linear"),  k < W
        WarmupLR        lr = min_lr + (max_lr - min_lr) x gamma(k), then max_lr
        WarmupDecayLR   ... then (max_lr - min_lr) x max(0, (T - k) / max(1, T - W)) + min_lr
        WarmupCosineLR  lr = base_lr x ratio(k): warmup_min_ratio + (1 - warmup_min_ratio)
                        x gamma(k), then cos_min_ratio + (1 - cos_min_ratio)
                        x (1 + cos(pi (k - W + 1) / (T - W))) / 2, at least 0

    (W = warmup_num_steps, T = total_num_steps, base_lr = the optimizer's lr)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        kind: str,
        *,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        total_num_steps: int | None = None,
        warmup_min_ratio: float = 0.0,
        cos_min_ratio: float = 0.0001,
    ) -> None:
        self.kind = kind
        self.warmup_min_lr, self.warmup_max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total_num_steps = int(total_num_steps or 0)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        super().__init__(optimizer)

    def _gamma(self, k: int) -> float:
        if self.warmup_type == "log":
            return math.log(k + 1) / math.log(self.warmup_num_steps)
        return k / self.warmup_num_steps

    def lr_at(self, k: int, base_lr: float) -> float:
        """The learning rate at iteration ``k`` (update k + 1) for a group whose
        configured lr is ``base_lr``."""
        w, t = self.warmup_num_steps, self.total_num_steps
        if k < 0:  # before DeepSpeed's scheduler has started: the first update's
            return 0.0 if self.kind == "WarmupCosineLR" else self.warmup_min_lr
        if self.kind == "WarmupCosineLR":
            if k < w:
                ratio = self.warmup_min_ratio + (1 - self.warmup_min_ratio) * self._gamma(k)
            else:
                cosine = (1 + math.cos(math.pi * (k - w + 1) / max(1, t - w))) / 2
                ratio = max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)
            return base_lr * ratio
        delta = self.warmup_max_lr - self.warmup_min_lr
        if k < w:
            gamma = self._gamma(k)
        elif self.kind == "WarmupDecayLR":
            gamma = max(0.0, (t - k) / max(1, t - w))
        else:
            gamma = 1.0
        return self.warmup_min_lr + delta * gamma

    def get_lr(self) -> list[float]:  # type: ignore[override]
        # torch's last_epoch is the number of updates stepped past (0 at the start)
        return [self.lr_at(self.last_epoch - 1, float(base)) for base in self.base_lrs]
