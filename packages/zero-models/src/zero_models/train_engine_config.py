"""The engine's configuration from zero-train's options: the ZeroConfig of the command
line (stage, dtypes, accumulation, clipping, offload tiers, hierarchy, mixed hardware), or
of a --deepspeed config with what the flags add to it; and the checks of those settings
that can fail before a rank starts (offload flags, hierarchy sizes, a DeepSpeed config's
clashes with the flags), each raising or returning one line that names the flag.

train_options.py parses and checks the command line as a whole and calls these.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import zero_core
from zero_core.config.choices import SHORT_DTYPE_NAMES, offload_stage_error
from zero_core.hybrid_sharding import hierarchy_sizes

from .hetero_options import hetero_settings, with_hetero

DTYPES = SHORT_DTYPE_NAMES


def offload_error(args: argparse.Namespace) -> str:
    """What is wrong with the offload flags ("" if nothing): checked before launching."""
    wrong_stage = offload_stage_error(args.stage, args.offload_optimizer, args.offload_params)
    if wrong_stage:
        return f"--stage {args.stage} with --offload-optimizer/--offload-params: {wrong_stage}"
    disk = "disk" in (args.offload_optimizer, args.offload_params)
    if disk and args.offload_dir is None:
        return "--offload-optimizer/--offload-params disk need --offload-dir DIR (swap files)"
    if args.offload_dir is not None and not disk:
        return "--offload-dir is for the disk tiers: add --offload-optimizer disk or drop it"
    if disk:
        try:
            zero_core.check_offload_dir(args.offload_dir, 0)
        except (ValueError, OSError) as exc:
            return f"--offload-dir {args.offload_dir}: {exc}"
    return ""


HIERARCHY_FLAGS = "--shard-group/--hpz/--quantize-*"


def check_hierarchy(args: argparse.Namespace, data_parallel: int) -> None:
    """The engine's own check of the hierarchy sizes, on ``data_parallel`` ranks, before
    any rank starts; a DeepSpeed config's (mics_shard_size, zero_hpz_partition_size, ...)
    is checked after it is read. Raises ValueError."""
    setup = getattr(args, "deepspeed_setup", None)
    config = setup.zero if setup is not None else zero_core.ZeroConfig(
        stage=args.stage, **hierarchy_settings(args)
    )  # fmt: skip
    where = "--deepspeed " + str(args.deepspeed) if setup is not None else HIERARCHY_FLAGS
    try:
        hierarchy_sizes(config, data_parallel)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def hierarchy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ZeroConfig fields of --shard-group, --hpz and --quantize-* (issue 16)."""
    return {
        "shard_group_size": args.shard_group,
        "hpz_partition_size": args.hpz,
        "quantize_weights": args.quantize_weights,
        "quantize_gradients": args.quantize_gradients,
    }


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ZeroConfig fields of the command line (a DeepSpeed config gives its own)."""
    fused = {"optimizer_in_backward": True, "nonfinite": "raise"}
    return {
        "stage": args.stage,
        "param_dtype": DTYPES[args.dtype],
        "reduce_dtype": None if args.reduce_dtype is None else DTYPES[args.reduce_dtype],
        "gradient_accumulation_steps": args.grad_accum,
        "clip_grad_norm": args.clip or None,
        "offload_optimizer": args.offload_optimizer,
        "offload_params": args.offload_params,
        "offload_gradients": args.offload_gradients,
        "offload_dir": None if args.offload_dir is None else str(args.offload_dir),
        **hierarchy_settings(args),
        **hetero_settings(args),
        **(fused if args.optimizer_in_backward else {}),
        "delayed_parameter_update": args.delayed_parameter_update,
    }


def run_zero_config(args: argparse.Namespace) -> zero_core.ZeroConfig:
    """The engine's configuration of a parsed run: its --deepspeed config's, else the
    command line's."""
    setup = getattr(args, "deepspeed_setup", None)
    if setup is None:
        return zero_core.ZeroConfig(**engine_settings(args))
    return with_hetero(args, with_delayed_update(args, setup.zero))


def with_delayed_update(
    args: argparse.Namespace, zero: zero_core.ZeroConfig
) -> zero_core.ZeroConfig:
    """``zero`` (a --deepspeed config's, which has no such key) with
    --delayed-parameter-update applied. Raises ValueError naming the flag."""
    if not args.delayed_parameter_update:
        return zero
    try:
        return dataclasses.replace(zero, delayed_parameter_update=True)
    except ValueError as exc:
        raise ValueError(f"--delayed-parameter-update with --deepspeed: {exc}") from None


def apply_deepspeed(args: argparse.Namespace, virtual: int) -> None:
    """Read --deepspeed for ``virtual`` data-parallel ranks (its "auto" values from the flags) and
    let it set stage, precision, batch, accumulation and clipping; the engine builds the
    config's optimizer and scheduler (``args.deepspeed_setup``). With
    --micro-batches-per-rank a DeepSpeed "GPU" is one virtual rank (one micro-batch slot);
    without, ``virtual`` is the data-parallel size. Raises ValueError."""
    flags = {
        "train_micro_batch_size_per_gpu": args.batch_size // virtual,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.batch_size * args.grad_accum,
        "bf16.enabled": args.dtype == "bf16", "fp16.enabled": args.dtype == "fp16",
        "gradient_clipping": args.clip, "zero_optimization.stage": args.stage,
        "optimizer.params.lr": args.lr, "optimizer.params.betas": [0.9, 0.95],
        "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": args.lr,
        "scheduler.params.warmup_num_steps": max(args.warmup, 2),
        "scheduler.params.total_num_steps": args.steps,
    }  # fmt: skip
    setup = zero_core.read_deepspeed(args.deepspeed, world_size=virtual, auto=flags)
    zero = setup.zero
    if zero.offload_dir is not None and "disk" in (zero.offload_optimizer, zero.offload_params):
        # The check --offload-dir gets; a missing folder is refused, not created (a typo
        # would put the swap files on whatever disk holds the new folder).
        try:
            zero_core.check_offload_dir(zero.offload_dir, 0)
        except (ValueError, OSError) as exc:
            raise ValueError(f"--deepspeed {args.deepspeed}: nvme_path: {exc}") from None
    names = {dtype: name for name, dtype in DTYPES.items()}
    ruled = {
        "stage": zero.stage,
        "dtype": names[zero.param_dtype],
        "grad_accum": zero.gradient_accumulation_steps,
        "clip": zero.clip_grad_norm or 0.0,
    }
    if setup.micro_batch_size is not None:
        ruled["batch_size"] = setup.micro_batch_size * virtual
    if setup.optimizer is not None:
        ruled["lr"] = setup.optimizer[1].get("lr", args.lr)
    # A flag given on the command line (or in --config) that the DeepSpeed config rules
    # otherwise would be dropped without a word: refused instead, naming both.
    clashes = [
        f"--{dest.replace('_', '-')} {getattr(args, dest)} (the config gives {value})"
        for dest, value in ruled.items()
        if dest in args.given and getattr(args, dest) != value
    ]
    if clashes:
        raise ValueError(
            f"--deepspeed {args.deepspeed} rules {', '.join(clashes)}; drop those flags or "
            'set the values in the config (an absent key is zero_core\'s default; "auto" '
            "takes the flag's)"
        )
    for dest, value in ruled.items():
        setattr(args, dest, value)
    with_delayed_update(args, zero)  # refused here, before launching, if it cannot be
    args.deepspeed_setup = setup
