"""Where ``initialize`` finds its DeepSpeed config, and the sections it refuses by name.

The config is ``config`` (a dict or a JSON file's path), ``config_params`` (DeepSpeed's
older name for it) or ``args.deepspeed_config`` (``--deepspeed_config``): exactly one of
them, as DeepSpeed requires. Sections that switch on a DeepSpeed feature zero_core does
not have are refused naming the feature; the same sections switched off (``"enabled":
false``, or every value false/null) change nothing and are accepted (listed once at
start). ``dataloader_drop_last`` is the facade's own (dataloader.py). Every other key goes
to zero_core.read_deepspeed, which accepts or refuses it by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .unsupported import unsupported

# Top-level sections of features the engine does not have -> what they are, and advice.
FEATURE_SECTIONS = {
    "pipeline": ("the pipeline engine", "train with ZeRO or zero_core.ModelParallel"),
    "activation_checkpointing": (
        "DeepSpeed's activation checkpointing (deepspeed.checkpointing)",
        "use zero_core.ActivationCheckpointing or torch.utils.checkpoint",
    ),
    "sparse_attention": ("sparse attention kernels", ""),
    "compression_training": ("DeepSpeed Compression", ""),
    "data_efficiency": ("data efficiency (curriculum learning, random-LTD)", ""),
    "curriculum_learning": ("curriculum learning", "order the data in your own sampler"),
    "elasticity": ("elastic training", "relaunch with another world size: checkpoints reshard"),
    "autotuning": ("the autotuner", ""),
    "amp": ("NVIDIA Apex AMP", 'use "bf16" or "fp16"'),
    "hybrid_engine": ("the hybrid (RLHF generation) engine", ""),
    "tensor_parallel": ("AutoTP tensor parallelism", "use zero_core.ModelParallel"),
    "sequence_parallel_size": ("Ulysses sequence parallelism", ""),
    "torch_autocast": ("torch.autocast mixed precision", 'use "bf16" or "fp16"'),
    "compile": ("deepspeed.compile", "call torch.compile on the module yourself"),
    "nebula": ("Nebula checkpointing", ""),
    "weight_quantization": ("weight quantization", ""),
}
# Sections whose default is a value that asks for nothing, other than false/null/0.
OFF_VALUES = {"sequence_parallel_size": 1}
FACADE_KEYS = ("dataloader_drop_last",)


def config_dict(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    """The one DeepSpeed config given, as a dict (module doc)."""
    if config is not None and config_params is not None:
        raise ValueError(
            "initialize was given both config= and config_params= (its older name): pass one"
        )
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ValueError(
            f"initialize was given config= and args.deepspeed_config={from_args!r}: pass "
            "one of them (DeepSpeed refuses both too)"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "initialize needs a DeepSpeed config: config={...} (or a JSON file's path), or "
            "--deepspeed_config FILE with args= (deepspeed.add_config_arguments(parser))"
        )
    if isinstance(config, Mapping):
        return dict(config)
    try:
        loaded = json.loads(Path(config).read_text())
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"DeepSpeed config {config!r}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config {config}: a JSON object is needed")
    return loaded


def split_facade_keys(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the config for zero_core.read_deepspeed, the facade's own keys, one note per
    switched-off feature section); a switched-on feature section raises naming it."""
    engine_keys: dict[str, Any] = {}
    own: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in config.items():
        if key in FACADE_KEYS:
            own[key] = value
        elif key in FEATURE_SECTIONS:
            if not (_asks_for_nothing(value) or OFF_VALUES.get(key, 0) == value):
                feature, advice = FEATURE_SECTIONS[key]
                raise unsupported(f'the config section "{key}" ({feature})', advice)
            notes.append(f"{key}: switched off, accepted")
        else:
            engine_keys[key] = value
    return engine_keys, own, notes


def _asks_for_nothing(value: Any) -> bool:
    """A section switched off: ``"enabled": false``, or every value false/null/0/empty."""
    if isinstance(value, Mapping):
        if "enabled" in value:
            return value["enabled"] is False
        return all(_asks_for_nothing(v) for v in value.values())
    return not value
