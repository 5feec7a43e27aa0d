"""DeepSpeed config keys that zero_core accepts because their value changes nothing, and
why any other value of them is refused (zero_config.translate_deepspeed reads these).

A DeepSpeed config carries many keys at their default or disabled values
(``"prescale_gradients": false``, ``"fp16": {"fp16_master_weights_and_grads": false}``,
``"amp": {"enabled": false}``). Refusing them cost a relaunch each; accepting them is
safe exactly when the value is DeepSpeed's default (or "off"), which asks for nothing
zero_core does differently. Each accepted key is listed once in ``no_effect`` (warned by
``initialize``); another value is refused with the reason and, where there is one, the
setting that does it here. Sources: DeepSpeed's docs/config-json and its
runtime/constants.py, runtime/zero/config.py, activation_checkpointing/config.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class Inert(NamedTuple):
    """A key accepted at ``accepted`` values (DeepSpeed's default, or "off"); ``refusal``
    says why another value cannot be honoured and what to do instead."""

    accepted: tuple[Any, ...]
    refusal: str


_REMOVE = "remove it (or set it to DeepSpeed's default)"
_ONE_DIVISION = (
    "zero_core sums the ranks' gradients (in rank order, bit-exact) and divides by the "
    "world size once, after the sum; a division before it would change the bits"
)

# Top-level keys.
INERT_KEYS: dict[str, Inert] = {
    "prescale_gradients": Inert((False,), f"is not supported: {_ONE_DIVISION}; {_REMOVE}"),
    "gradient_predivide_factor": Inert((1.0,), f"is not supported: {_ONE_DIVISION}; {_REMOVE}"),
    "sparse_gradients": Inert(
        (False,), f"is not supported: gradients are dense flat buffers here; {_REMOVE}"
    ),
    "zero_force_ds_cpu_optimizer": Inert(
        (True, False), "is accepted at any value (there is no DeepSpeed CPU optimizer here)"
    ),
    "graph_harvesting": Inert((False,), f"is not supported (CUDA graphs); {_REMOVE}"),
    "disable_allgather": Inert((False,), f"is not supported; {_REMOVE}"),
    "gradient_allreduce_op": Inert(
        ("mean",), f"is not supported: gradients are averaged over the ranks; {_REMOVE}"
    ),
    "seq_parallel_communication_data_type": Inert(
        ("fp32",), f"is not supported: there is no sequence parallelism here; {_REMOVE}"
    ),
    "dataloader_drop_last": Inert((False,), f"is not supported by the engine; {_REMOVE}"),
}

# Keys inside a section: section -> key -> Inert.
INERT_SECTION_KEYS: dict[str, dict[str, Inert]] = {
    "fp16": {
        "fp16_master_weights_and_grads": Inert(
            (False,),
            "is not supported: zero_core keeps float32 master weights and optimizer states "
            f"for float16 compute; {_REMOVE}",
        ),
    },
    "bf16": {
        "check_overflow": Inert(
            (False,),
            "is not supported as a DeepSpeed key: ZeroConfig(nonfinite='skip') skips a "
            "step whose reduced gradients hold a NaN or Inf",
        ),
        "immediate_grad_update": Inert((True,), f"is not supported; {_REMOVE}"),
        "bf16_master_weights_and_grads": Inert(
            (False,),
            "is not supported: zero_core keeps float32 master weights for bfloat16 compute; "
            + _REMOVE,
        ),
        "bf16_optimizer_states": Inert(
            (False,), f"is not supported: optimizer states are float32; {_REMOVE}"
        ),
    },
    "zero_optimization": {
        "elastic_checkpoint": Inert(
            (True, False), "is accepted at any value (checkpoints load at any world size)"
        ),
        "load_from_fp32_weights": Inert(
            (True,),
            "is not supported: a checkpoint always restores the float32 master weights; " + _REMOVE,
        ),
        "ignore_unused_parameters": Inert((True,), f"is not supported; {_REMOVE}"),
        "use_multi_rank_bucket_allreduce": Inert((True, False), "is accepted at any value"),
        "legacy_stage1": Inert((False,), f"is not supported; {_REMOVE}"),
        "cpu_offload": Inert((False,), ""),  # true: read as offload_optimizer (DEPRECATED)
        "cpu_offload_param": Inert((False,), ""),  # true: read as offload_param
        "cpu_offload_use_pin_memory": Inert((False,), ""),  # true: offload pin_memory
        "stage3_gather_fp16_weights_on_model_save": Inert(
            (True, False), "is accepted at any value (full_state_dict() gathers on demand)"
        ),
        "stage3_model_persistence_threshold": Inert((2**63 - 1,), f"is not supported; {_REMOVE}"),
        "stage3_module_granularity_threshold": Inert((0,), f"is not supported; {_REMOVE}"),
        "stage3_use_all_reduce_for_fetch_params": Inert((False,), f"is not supported; {_REMOVE}"),
        "stage3_allgather_sequential": Inert((False,), f"is not supported; {_REMOVE}"),
        "zero_quantized_nontrainable_weights": Inert((False,), f"is not supported; {_REMOVE}"),
        "memory_efficient_linear": Inert((True, False), "is accepted at any value"),
        "pipeline_loading_checkpoint": Inert((False,), f"is not supported; {_REMOVE}"),
        "override_module_apply": Inert((True,), f"is not supported; {_REMOVE}"),
        "log_trace_cache_warnings": Inert((False,), f"is not supported; {_REMOVE}"),
        "enable_sanity_checks": Inert((False,), f"is not supported; {_REMOVE}"),
    },
    "checkpoint": {
        "tag_validation": Inert(
            ("WARN", "IGNORE", "FAIL"),
            "must be Warn, Ignore or Fail (zero_core always refuses different tags on "
            "different ranks, naming each rank's)",
        ),
        "load_universal": Inert(
            (False,),
            "is not supported: zero_core's own checkpoints load at any world size and stage; "
            "DeepSpeed's universal checkpoints are not read",
        ),
        "use_node_local_storage": Inert((False,), f"is not supported; {_REMOVE}"),
        "parallel_write": Inert(({"pipeline_stage": False}, {}), f"is not supported; {_REMOVE}"),
    },
    "data_types": {
        "grad_accum_dtype": Inert(
            (None,),
            "is not supported: gradients accumulate in the compute dtype; a float32 "
            "reduction is coming as ZeroConfig's reduce_dtype",
        ),
        "param_dtype": Inert((None,), "is not supported: use the bf16 or fp16 section"),
        "buffer_dtype": Inert((None,), f"is not supported; {_REMOVE}"),
    },
    "activation_checkpointing": {
        name: Inert(
            (default,),
            "is not supported as a DeepSpeed key: activation checkpointing is set on the "
            "model (zero_core.zero_r.activation_checkpoint)",
        )
        for name, default in (
            ("partition_activations", False),
            ("cpu_checkpointing", False),
            ("contiguous_memory_optimization", False),
            ("number_checkpoints", None),
            ("synchronize_checkpoint_boundary", False),
            ("profile", False),
        )
    },
}

# Sections accepted whatever else they hold while their "enabled" is false (or absent).
DISABLED_SECTIONS: dict[str, str] = {
    "amp": "NVIDIA Apex AMP is not supported: use the bf16 or fp16 section",
    "torch_autocast": "torch_autocast is not supported: use the bf16 or fp16 section",
    "eigenvalue": "eigenvalue is not supported",
    "progressive_layer_drop": "progressive layer drop is not supported",
    "curriculum_learning": "curriculum learning is not supported (a data loader's job)",
    "data_efficiency": "data efficiency is not supported (a data loader's job)",
    "elasticity": "elastic training is not supported",
    "autotuning": "autotuning is not supported",
    "nebula": "Nebula checkpointing is not supported",
}

# DeepSpeed's deprecated zero_optimization booleans, read as it reads them when true.
DEPRECATED_OFFLOAD = {
    "cpu_offload": ("offload_optimizer", 'offload_optimizer: {"device": "cpu"}'),
    "cpu_offload_param": ("offload_params", 'offload_param: {"device": "cpu"}'),
}
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def is_accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    """``value`` is one of ``accepted``, strictly: ``0`` is not ``False``, and text is
    compared without case (DeepSpeed reads "Warn" as "WARN")."""
    for candidate in accepted:
        if isinstance(candidate, bool) or candidate is None:
            if value is candidate:
                return True
        elif isinstance(candidate, str):
            if isinstance(value, str) and value.upper() == candidate.upper():
                return True
        elif not isinstance(value, bool) and value == candidate:
            return True
    return False


def check_inert(path: str, value: Any, inert: Inert, notes: list[str], problems: list[str]) -> None:
    """Note ``path`` as accepted without effect, or add its refusal to ``problems``."""
    if value == "auto" or is_accepted(value, inert.accepted):
        notes.append(f"{path}={value!r}: accepted, no effect")
    else:
        problems.append(f"{path}={value!r} {inert.refusal}")


def check_inert_section(key: str, section: Any, notes: list[str], problems: list[str]) -> bool:
    """A whole section of INERT_SECTION_KEYS (checkpoint, data_types, ...) or of
    DISABLED_SECTIONS checked into ``notes``/``problems``; False if ``key`` is neither."""
    if key not in DISABLED_SECTIONS and key not in INERT_SECTION_KEYS:
        return False
    if not isinstance(section, Mapping):
        problems.append(f"{key} must be a dict, got {section!r}")
        return True
    if key in DISABLED_SECTIONS:
        enabled = section.get("enabled", False)
        if enabled is False:
            notes.append(f"{key}: disabled, accepted, no effect")
        else:
            problems.append(f"{key}.enabled={enabled!r}: {DISABLED_SECTIONS[key]}; remove it")
        return True
    table = INERT_SECTION_KEYS[key]
    for sub, value in section.items():
        if sub in table:
            check_inert(f"{key}.{sub}", value, table[sub], notes, problems)
        else:
            problems.append(
                f"DeepSpeed config key {key}.{sub} is not supported by zero_core; accepted "
                f"under {key!r} at DeepSpeed's defaults: {', '.join(table)}"
            )
    return True
