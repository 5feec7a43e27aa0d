"""DeepSpeed's config keys read as ZeroConfig settings: which key sets which field, which
are accepted without effect (with a note), and which are refused (each with its fix).

    translate_deepspeed(config) -> (ZeroConfig settings, notes)

ZeroConfig.from_deepspeed and config.deepspeed_json call it; it never builds a ZeroConfig.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .choices import DEFAULT_STAGE, DTYPES
from .deepspeed_inert import (
    DEPRECATED_OFFLOAD,
    DTYPE_NAMES,
    INERT_KEYS,
    INERT_SECTION_KEYS,
    check_inert,
    check_inert_section,
)

DEEPSPEED_KEYS: dict[str, str | dict[str, str | None]] = {
    "zero_optimization": {
        "stage": "stage",
        "reduce_bucket_size": "bucket_numel",
        "overlap_comm": "overlap_comm",
        "stage3_prefetch_bucket_size": "prefetch_numel",
        "stage3_max_live_parameters": "max_live_numel",
        "stage3_param_persistence_threshold": "persistence_threshold",
        "sub_group_size": "offload_sub_group_numel",
        "mics_shard_size": "shard_group_size",
        "mics_hierarchical_params_gather": "hierarchical_gather",
        "zero_hpz_partition_size": "hpz_partition_size",
        "zero_quantized_weights": "quantize_weights",
        "zero_quantized_gradients": "quantize_gradients",
    },
    "aio": {"thread_count": "offload_io_threads"},
    "bf16": {"enabled": None},
    "fp16": {
        "enabled": None,
        "loss_scale": "loss_scale",
        "initial_scale_power": None,
        "loss_scale_window": "loss_scale_window",
        "hysteresis": "hysteresis",
        "min_loss_scale": "min_loss_scale",
    },
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "clip_grad_norm",
    "zero_allow_untested_optimizer": "allow_untested_optimizer",
}
# Read by zero_core.config.deepspeed_json (they configure the training loop, not the engine).
TRAINER_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler")
# Accepted and without effect here: logging and profiling, and what zero_core always does
# (contiguous buckets, reduce-scatter) or does its own way.
NO_EFFECT_KEYS = (
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler", "comet",
)  # fmt: skip
NO_EFFECT_ZERO_KEYS = (
    "contiguous_gradients", "allgather_partitions", "reduce_scatter",
    "allgather_bucket_size",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "round_robin_gradients",
)  # fmt: skip
# DeepSpeed's offload sections: key -> ZeroConfig field (None: accepted, no effect here).
OFFLOAD_SECTION_KEYS: dict[str, dict[str, str | None]] = {
    "offload_optimizer": {
        "device": "offload_optimizer", "nvme_path": "offload_dir",
        "pin_memory": "offload_pin_memory", "buffer_count": "offload_buffer_count",
        "ratio": "offload_fraction", "fast_init": None, "pipeline": None,
        "pipeline_read": None, "pipeline_write": None,
    },
    "offload_param": {
        "device": "offload_params", "nvme_path": "offload_dir",
        "pin_memory": "offload_pin_memory", "buffer_count": None, "buffer_size": None,
        "max_in_cpu": None,
    },
}  # fmt: skip
# DeepSpeed's offload devices by ours ("nvme" is any disk folder here).
DEEPSPEED_OFFLOAD_DEVICES = {"none": "none", "cpu": "cpu", "nvme": "disk", None: "none"}
NO_EFFECT_AIO_KEYS = (
    "block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism",
    "use_gds",
)  # fmt: skip
NO_EFFECT_PRECISION_KEYS = ("auto_cast", "consecutive_hysteresis")


# DeepSpeed's older spellings of a section, which it still reads: alias -> section.
DEEPSPEED_SECTION_ALIASES = {"bfloat16": "bf16"}
# zero_core's mixed-hardware fields (docs/mixed-hardware.md), which users put into a
# DeepSpeed config by habit. They are refused, not taken: a DeepSpeed config's batch
# arithmetic (train_batch_size = micro x accumulation x ranks) counts ranks, not
# micro-batch slots, so the same file would mean another batch under DeepSpeed.
ZERO_CORE_ONLY_KEYS = {
    "micro_batches_per_rank": "--micro-batches-per-rank",
    "shard_weights": "--shard-weights",
}


def zero_core_only_key(path: str, name: str, value: Any) -> str:
    """The refusal of a zero_core-only key found in a DeepSpeed config, naming the fix."""
    text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    return (
        f"DeepSpeed config key {path!r} is zero_core's ZeroConfig field {name!r}, not a "
        "DeepSpeed key, and is not read from a DeepSpeed config (whose train_batch_size "
        "counts ranks, not micro-batch slots): remove it and give it to zero-train as "
        f"{ZERO_CORE_ONLY_KEYS[name]} {text} (with --deepspeed too), or to "
        f"zero_core.ZeroConfig({name}=...)"
    )


def canonical_deepspeed(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with DeepSpeed's older section names read as today's ("bfloat16" is
    "bf16"), as DeepSpeed reads them; both spellings at once is an error naming them."""
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config must be a dict, got {type(config).__name__}")
    out = dict(config)
    for alias, section in DEEPSPEED_SECTION_ALIASES.items():
        if alias not in out:
            continue
        if section in out:
            raise ValueError(
                f"DeepSpeed config has both {alias!r} and {section!r} (the same section, "
                f"two spellings): keep {section!r}"
            )
        out[section] = out.pop(alias)
    return out


def translate_deepspeed(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ZeroConfig settings of a DeepSpeed config's engine keys, and one line for each
    key accepted without effect (or whose "auto" means zero_core's default): DeepSpeed's
    keys at their default or disabled values are accepted (config.deepspeed_inert). The
    trainer's keys (TRAINER_KEYS) are skipped: zero_core.config.deepspeed_json reads them.
    Every key that cannot be honoured is named in one ValueError, with its fix."""
    config = canonical_deepspeed(config)
    out: dict[str, Any] = {}
    notes: list[str] = []
    problems: list[str] = []  # every refusal, raised together at the end
    deprecated: dict[str, str] = {}  # ZeroConfig field -> the deprecated key that set it
    for key, value in config.items():
        if key in TRAINER_KEYS or key == "communication_data_type":  # (the latter: below)
            continue
        if key in ZERO_CORE_ONLY_KEYS:
            problems.append(zero_core_only_key(key, key, value))
            continue
        if key in NO_EFFECT_KEYS:
            notes.append(f"{key}: accepted, no effect (logging and profiling are zero-train's)")
            continue
        if key in INERT_KEYS:
            check_inert(key, value, INERT_KEYS[key], notes, problems)
            continue
        if key not in DEEPSPEED_KEYS and check_inert_section(key, value, notes, problems):
            continue
        if key not in DEEPSPEED_KEYS:
            problems.append(
                f"DeepSpeed config key {key!r} is not supported by zero_core; supported: "
                f"{', '.join(sorted([*DEEPSPEED_KEYS, *TRAINER_KEYS]))}, the logging "
                f"keys {', '.join(NO_EFFECT_KEYS)}, and DeepSpeed's keys at their default "
                "values. Remove it"
            )
            continue
        target = DEEPSPEED_KEYS[key]
        if isinstance(target, str):
            if value == "auto":
                notes.append(f"{key}: 'auto' means zero_core's default")
            else:
                out[target] = value
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"DeepSpeed config {key!r} must be a dict, got {value!r}")
        for sub, sub_value in value.items():
            if sub in ZERO_CORE_ONLY_KEYS:
                problems.append(zero_core_only_key(f"{key}.{sub}", sub, sub_value))
                continue
            if key == "zero_optimization" and sub in OFFLOAD_SECTION_KEYS:
                _offload_section(sub, sub_value, out, notes, problems)
                continue
            if key == "zero_optimization" and sub_value is True and sub in DEPRECATED_OFFLOAD:
                deprecated[DEPRECATED_OFFLOAD[sub][0]] = sub
                continue
            if key == "zero_optimization" and sub == "cpu_offload_use_pin_memory" and sub_value:
                out["offload_pin_memory"] = True  # DeepSpeed's deprecated spelling of it
                continue
            inert = INERT_SECTION_KEYS.get(key, {}).get(sub)
            if inert is not None:
                check_inert(f"{key}.{sub}", sub_value, inert, notes, problems)
                continue
            if _no_effect(key, sub, sub_value, notes):
                continue
            if key == "zero_optimization" and sub == "stage3_max_reuse_distance":
                _reuse_distance(sub_value, out, notes)
                continue
            if sub not in target:
                problems.append(
                    f"DeepSpeed config key {key}.{sub} is not supported by zero_core; "
                    f"supported under {key!r}: {', '.join(target)}, and DeepSpeed's keys at "
                    "their default values"
                )
                continue
            name = target[sub]
            if sub_value == "auto" and sub != "enabled":
                notes.append(f"{key}.{sub}: 'auto' means zero_core's default")
            elif name is not None:
                out[name] = sub_value
    _deprecated_offload(deprecated, out, notes, problems)
    stage = out.get("stage", DEFAULT_STAGE)
    if out.get("overlap_comm") is False and isinstance(stage, int) and stage >= 2:
        notes.append(
            "zero_optimization.overlap_comm=false: no effect at stages 2 and 3 (they hold "
            "no full gradient, so they always reduce during backward)"
        )
    if out.get("clip_grad_norm") == 0:
        out["clip_grad_norm"] = None  # DeepSpeed's default, meaning no clipping
    bf16 = _enabled(config, "bf16")
    fp16 = _enabled(config, "fp16")
    if bf16 and fp16:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable one of them")
    if fp16:
        out["param_dtype"] = torch.float16
        power = config["fp16"].get("initial_scale_power")
        if power is not None and power != "auto":
            if not isinstance(power, int) or isinstance(power, bool) or not 0 <= power < 128:
                raise ValueError(f"fp16.initial_scale_power={power!r} must be an integer 0-127")
            out["initial_loss_scale"] = 2.0**power
    else:
        # A disabled fp16 section's settings do not apply.
        for name in ("loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
            out.pop(name, None)
        if bf16:
            out["param_dtype"] = torch.bfloat16
    for name in ("bucket_numel", "prefetch_numel", "max_live_numel", "persistence_threshold",
                 "offload_sub_group_numel"):  # fmt: skip
        size = out.get(name)
        if isinstance(size, float) and size.is_integer():
            out[name] = int(size)  # DeepSpeed configs write 5e8
    _communication_dtype(config, out.get("param_dtype", torch.float32), out, notes, problems)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(
            f"DeepSpeed config: {len(problems)} keys cannot be honoured by zero_core (all of "
            "them, so that one relaunch is enough):\n  - " + "\n  - ".join(problems)
        )
    return out, notes


def _deprecated_offload(
    deprecated: dict[str, str], out: dict[str, Any], notes: list[str], problems: list[str]
) -> None:
    """DeepSpeed's deprecated ``cpu_offload: true`` (``cpu_offload_param: true``) is its
    ``offload_optimizer`` (``offload_param``) on the CPU, as DeepSpeed reads it: honoured,
    with a note; beside a section of the new spelling that says otherwise, refused."""
    for name, key in deprecated.items():
        spelling = DEPRECATED_OFFLOAD[key][1]
        if out.get(name, "none") not in ("none", "cpu"):
            problems.append(
                f"zero_optimization.{key}=true (DeepSpeed's deprecated {spelling}) contradicts "
                f"{name.replace('params', 'param')}.device={out[name]!r}: keep the section"
            )
            continue
        out[name] = "cpu"
        notes.append(f"zero_optimization.{key}=true: deprecated in DeepSpeed, read as {spelling}")


def _communication_dtype(
    config: Mapping[str, Any],
    compute: torch.dtype,
    out: dict[str, Any],
    notes: list[str],
    problems: list[str],
) -> None:
    """``communication_data_type``: the dtype gradients are reduced in, ZeroConfig's
    ``reduce_dtype`` (float32 from 16-bit compute; the compute dtype itself changes
    nothing). ZeroConfig refuses the others, naming the choices."""
    if "communication_data_type" not in config:
        return
    value = config["communication_data_type"]
    named = DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if value is None or named == str(compute).removeprefix("torch."):
        notes.append(f"communication_data_type={value!r}: the compute dtype, no effect")
        return
    if not isinstance(value, str) or value not in DTYPES:
        problems.append(
            f"communication_data_type={value!r}: give one of {', '.join(sorted(DTYPES))}"
        )
        return
    out["reduce_dtype"] = value


def _offload_section(
    key: str, section: Any, out: dict[str, Any], notes: list[str], problems: list[str]
) -> None:
    """``zero_optimization.offload_optimizer`` / ``offload_param`` into ``out``."""
    if not isinstance(section, Mapping):
        raise ValueError(
            f"DeepSpeed config zero_optimization.{key} must be a dict, got {section!r}"
        )
    targets = OFFLOAD_SECTION_KEYS[key]
    for sub, value in section.items():
        if sub not in targets:
            problems.append(
                f"DeepSpeed config key zero_optimization.{key}.{sub} is not supported by "
                f"zero_core; supported under {key!r}: {', '.join(targets)}"
            )
            continue
        name = targets[sub]
        if name is None or value == "auto":
            notes.append(f"zero_optimization.{key}.{sub}: accepted, no effect")
            continue
        if sub == "device":
            if value not in DEEPSPEED_OFFLOAD_DEVICES:
                raise ValueError(
                    f"zero_optimization.{key}.device={value!r}: use 'none', 'cpu' or 'nvme' "
                    "(any folder: set nvme_path)"
                )
            value = DEEPSPEED_OFFLOAD_DEVICES[value]
        if name == "offload_dir" and out.get(name, value) != value:
            raise ValueError(
                f"zero_optimization.offload_optimizer.nvme_path ({out[name]!r}) and "
                f"offload_param.nvme_path ({value!r}) differ: zero_core keeps every swap file "
                "in one folder; give both the same path"
            )
        out[name] = value


def _reuse_distance(value: Any, out: dict[str, Any], notes: list[str]) -> None:
    """DeepSpeed's ``stage3_max_reuse_distance`` keeps a gathered parameter that is used
    again within that many parameter elements. The reuse it matters for is backward's
    start, which uses first what forward used last: zero_core keeps those units for
    backward up to ``backward_head_numel`` elements, so the distance is that bound, and 0
    turns the keeping off (``keep_backward_head=False``)."""
    if value == "auto":
        notes.append(
            "zero_optimization.stage3_max_reuse_distance: 'auto' means zero_core's default"
        )
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"zero_optimization.stage3_max_reuse_distance={value!r} must be a number >= 0 "
            "(parameter elements: 0 releases every unit after its forward; a distance keeps "
            "that many elements of backward's first units gathered from forward)"
        )
    out["keep_backward_head"] = value > 0
    if value > 0:
        out["backward_head_numel"] = int(value)


def _enabled(config: Mapping[str, Any], section: str) -> bool:
    value = config.get(section, {}).get("enabled", False)
    if value == "auto":
        raise ValueError(
            f"{section}.enabled is 'auto' and nothing resolved it: write true or false (a "
            "trainer passes its own setting: read_deepspeed(..., auto={'"
            + section
            + ".enabled': True})"
        )
    if not isinstance(value, bool):
        raise ValueError(f"{section}.enabled={value!r} must be true or false")
    return value


def _no_effect(section: str, key: str, value: Any, notes: list[str]) -> bool:
    """Whether ``section.key`` is accepted without effect (noted); raises where a value
    asks for what zero_core does not do."""
    if section == "aio" and key in NO_EFFECT_AIO_KEYS:
        notes.append(f"aio.{key}: accepted, no effect (swap I/O is a thread pool of pread/pwrite)")
        return True
    if section == "zero_optimization" and key in NO_EFFECT_ZERO_KEYS:
        notes.append(f"zero_optimization.{key}: accepted, no effect (zero_core's own way)")
        return True
    if section == "fp16" and key == "consecutive_hysteresis":
        if value not in (False, "auto"):
            raise ValueError(
                "fp16.consecutive_hysteresis=true is not supported: zero_core counts every "
                "overflow since the last growth; remove it or set it to false"
            )
        return True
    if section in ("fp16", "bf16") and key in NO_EFFECT_PRECISION_KEYS:
        notes.append(f"{section}.{key}: accepted, no effect (inputs are cast by default)")
        return True
    return False
