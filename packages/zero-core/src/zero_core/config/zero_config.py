"""``ZeroConfig``: what the engine is asked to do, validated when it is made.

    ZeroConfig(stage=2, param_dtype="bf16", bucket_numel=2**22, clip_grad_norm=1.0)
    ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})

A DeepSpeed-style dict is accepted for the keys listed in ``DEEPSPEED_KEYS``; any other key
is rejected by name rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .choices import (
    DEFAULT_STAGE,
    OFFLOAD_DEVICES,
    offload_stage_error,
    parse_dtype,
)
from .deepspeed_translation import TRAINER_KEYS, translate_deepspeed
from .delayed_update_rule import delayed_update_error
from .fused_step_rule import optimizer_in_backward_error
from .micro_batches_rule import CountsSetting, normalise_counts
from .shard_weights_rule import normalise_shard_weights, shard_weights_error


def _reduce_dtype(value: torch.dtype | str | None, param_dtype: torch.dtype) -> torch.dtype | None:
    """``reduce_dtype`` resolved: None (the compute dtype), or a dtype the gradients can be
    reduced in losslessly from ``param_dtype``: the compute dtype itself or float32. A
    narrower or different 16-bit dtype would round every gradient before its reduction."""
    if value is None:
        return None
    choices = (
        "use None (reduce in the compute dtype, the default) or 'fp32' / torch.float32 "
        "(FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.float32))"
    )
    try:
        dtype = parse_dtype(value, "reduce_dtype")
    except ValueError:
        raise ValueError(f"reduce_dtype={value!r} is not supported; {choices}") from None
    if dtype not in (param_dtype, torch.float32):
        raise ValueError(
            f"reduce_dtype={value!r} with param_dtype={param_dtype}: gradients are reduced in "
            f"the compute dtype or in a wider one, and {dtype} would round every "
            f"{param_dtype} gradient first; {choices}"
        )
    return dtype


# Stage 3's prefetch window: docs/stage3-memory.md measured 2**21..2**24 against the
# step's memory peak; 2**22 keeps the gathered peak at a third of 2**24's.
DEFAULT_PREFETCH_NUMEL = 2**22
# Stage 3's units kept from forward for backward's start: docs/step-profile.md measured
# 2**24 against the prefetch window (2**22) on the 19M GPT (step / DDP 1.19 -> 1.06-1.12 at
# N = 4) and in the largest-model search (the same largest models).
DEFAULT_BACKWARD_HEAD_NUMEL = 2**24
# Gradient buckets coalesced into one reduction when coalesce_numel is left unset. qgZ's
# collective costs about twice an exact reduce-scatter's (two all-to-alls, four codec
# passes), so it coalesces more. docs/across-nodes.md measured 0, 2**16, 2**18 and 2**20
# on the emulated cluster: an exact stage 3 lost overlap past 2**16 at 100 Mbit/s (steps
# 0.55 -> 0.61 s at 2**18), ZeRO++ was fastest at 2**18 (0.42-0.53 -> 0.30-0.32 s).
DEFAULT_COALESCE_NUMEL = 2**16
QGZ_COALESCE_NUMEL = 2**18
# Stage 3's units started together by a prefetch and gathered by one collective:
# docs/across-nodes.md ("Coalesced gathers") measured 0, 2**16, 2**18 and 2**20 in one
# process: 2**18 made the small GPT's step 1.15x faster (qwZ 1.36x, a 75-unit model
# 1.49x), 2**20 no better beyond the spread; on the emulated cluster no setting moved
# beyond the launches' spread.
DEFAULT_GATHER_COALESCE_NUMEL = 2**18


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of one engine.

    stage: 0 (plain data parallelism), 1 (partition optimizer states), 2 (+ gradients),
        3 (+ parameters, gathered module by module just in time).
    param_dtype: dtype of the compute parameters and gradients; the master weights and
        optimizer states are float32 whenever this is bfloat16 or float16.
    bucket_numel: elements per gradient bucket (reduce-scatter) and parameter all-gather;
        bounds the communication buffers whatever the model's size.
    gradient_accumulation_steps: backward calls per optimizer update.
    clip_grad_norm: clip gradients to this global L2 norm; None disables clipping.
    loss_scale: float16 only: 0 means dynamic loss scaling, > 0 a fixed scale.
    initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale: dynamic scaling
        starts at ``initial_loss_scale``, doubles after ``loss_scale_window`` steps without
        overflow, and halves (not below ``min_loss_scale``) after ``hysteresis`` overflows.
    max_buckets_in_flight: gradient collectives (stage 0: all-reduces, stages 1-3:
        reduce-scatters) outstanding at once during backward.
    coalesce_numel: stages 2 and 3: consecutive gradient buckets (in the order they are
        reduced) whose elements add up to at most this many (and at most ``bucket_numel``,
        which keeps bounding the buffers) are reduced by one collective, launched once the
        last of them is complete; 0 reduces each bucket by itself; None (the default):
        DEFAULT_COALESCE_NUMEL, or QGZ_COALESCE_NUMEL with ``quantize_gradients``
        (``coalesce_limit``). Stage 3's buckets never span two fetch units, so a model of
        many small modules otherwise pays a collective's fixed cost per module (qgZ: two
        all-to-alls and four codec passes). The same bits either way (grad_reducer says
        why); larger groups start later, so less of them overlaps backward.
    overlap_comm: stages 0 and 1: reduce each gradient bucket during backward, as soon
        as every parameter in it has its gradient (in one order on every rank, the same
        bits either way). False reduces them all after backward: the way to train a model
        whose parameters get a second gradient after their bucket was launched
        (reentrant activation checkpointing, ``checkpoint(..., use_reentrant=True)``),
        which is otherwise an error. Stages 2 and 3 hold no full gradient, so they always
        reduce during backward (use ``use_reentrant=False`` there). DeepSpeed's
        ``zero_optimization.overlap_comm``.
    prefetch_numel: stage 3: parameter elements gathered ahead of use (in the order recorded
        on the first step); 0 turns prefetching off. (What forward keeps for backward's
        start is bounded by ``backward_head_numel`` instead.)
    gather_coalesce_numel: stage 3: units a prefetch starts together (consecutive in the
        recorded order, gathered the same way) share one all-gather while their elements
        add up to at most this many; 0 gathers each unit by itself. The same bits either
        way (zero_comm.all_gather_coalesced). From its launch to the wait for its first
        unit, such a gather holds a received buffer of at most this many elements and a
        send buffer of 1/N of that, outside ``max_live_numel``. A model of many small
        modules otherwise pays a collective's fixed cost per module in forward.
    max_live_numel: stage 3: prefetching never makes more parameter elements gathered at
        once than this (the modules running now are always gathered, whatever their size).
    keep_backward_head: stage 3: a forward with gradients enabled keeps gathered the units
        backward starts with (its first unit and up to ``backward_head_numel`` elements of
        the units after it), instead of releasing them for backward to gather again: the
        head's elements are gathered once fewer per micro-step (param_gatherer). False
        releases every unit after its forward, for 3Ψ(N-1)/N exactly.
    backward_head_numel: stage 3, with ``keep_backward_head``: parameter elements past
        backward's first unit that forward keeps gathered for it (whole units, in
        backward's order, all within ``max_live_numel``). Up to this many elements more are
        gathered at backward's start than ``prefetch_numel`` alone would gather there.
        DeepSpeed's ``stage3_max_reuse_distance`` (0: ``keep_backward_head=False``).
    persistence_threshold: stage 3: parameters of at most this many elements (biases, norm
        weights) stay gathered on every rank; their gradients and optimizer states are
        still partitioned. 0 partitions every parameter.
    allow_untested_optimizer: accept an optimizer not known to be elementwise.
    nonfinite: what a NaN or Inf in the reduced gradients does (float16 always skips and
        backs the loss scale off): "skip" the step on every rank, or "raise" a
        FloatingPointError naming the first parameter (in model order) that went non-finite.
        Either way a NaN never reaches the parameters.
    cast_forward_inputs: floating-point tensors given to the engine's forward (also inside
        tuples, lists and dicts) are cast to ``param_dtype`` first, as FSDP2's
        MixedPrecisionPolicy does, so float32 data feeds a bfloat16 model. False passes
        them as they are.
    offload_optimizer: where this rank's float32 master weights and optimizer states live
        at stages 1-3: "none" (the device), "cpu" (host memory) or "disk" (swap files in
        ``offload_dir``, stepped in sub-groups through a read/step/write pipeline).
    offload_params: stage 3: where this rank's compute-parameter shards live between uses
        ("none", "cpu" or "disk"); a unit is fetched from its tier just before its gather.
    offload_dir: the folder of the swap files (needed by "disk"; checked for presence,
        write access and free space before anything is built).
    offload_fraction: the fraction of this rank's optimizer states (and masters) that goes
        to the ``offload_optimizer`` tier, counted in elements from the end of the shard;
        the rest stays on the device (DeepSpeed's ``ratio``).
    offload_sub_group_numel: elements per optimizer sub-group when offloading: the unit
        that is swapped and stepped at once (never more than one bucket's slice).
    offload_buffer_count: sub-groups resident at once in the disk pipeline (>= 3: one
        being read, one stepped, one written back).
    offload_io_threads: threads reading and writing swap files.
    offload_pin_memory: pin host buffers when the device is a GPU (falls back, with one
        warning, where pinning fails).
    offload_gradients: at stages 2 and 3 with ``offload_optimizer`` "cpu" or "disk", each
        bucket's reduced gradient slice leaves the device as soon as it lands, for the
        tier of the tiles it belongs to (host memory, or the disk pipeline beside the
        master and states), in ``gradient_dtype`` and accumulated there: the device then
        holds only the reductions in flight (``max_buckets_in_flight``), with the same
        bits (docs/offload.md, "The gradient tier"). False keeps them on the device, as
        before (for comparisons). No effect without ``offload_optimizer``, nor at stage 1
        (its full gradient buffers stay on the device anyway). zero-train:
        ``--no-offload-gradients``.
    shard_group_size: stages 1-3: hybrid sharding (MiCS, FSDP's HSDP): model states are
        partitioned over shard groups of this many consecutive ranks and replicated over
        the N / size groups; gradients are reduced within the group, then across the
        replicas (zero_comm.hierarchy; bit-identical to flat sharding under a
        deterministic communicator). None (or DeepSpeed's -1): one group of every rank.
        DeepSpeed's ``mics_shard_size``.
    hierarchical_gather: stage 3 with a shard group spanning nodes: gather parameters
        inside each node first, then across nodes (``mics_hierarchical_params_gather``).
    hpz_partition_size: stage 3 (ZeRO++ hpZ): keep a secondary copy of the gathered
        parameters partitioned over groups of this many consecutive ranks (one node), so
        the backward all-gather stays inside the group. 1 turns it off.
        DeepSpeed's ``zero_hpz_partition_size``.
    quantize_weights: stage 3 (ZeRO++ qwZ): the forward parameter all-gather moves int8
        blocks and their scales (lossy, deterministic). ``zero_quantized_weights``.
    quantize_gradients: stages 2-3 (ZeRO++ qgZ): "int4" or "int8" gradients reduced by a
        hierarchical all-to-all (lossy, deterministic); None (or False) turns it off and
        True means "int4". ``zero_quantized_gradients``.
    allow_quantize_fallback: where a quantized collective cannot run (see
        zero_comm.quantized), warn once and use the exact one; False makes it an error.
    release_host_heap: on a CPU device, or with model states offloaded to host memory or
        disk, give the C heap's free pages back to the system at the end of the build and
        of the first two optimizer steps, and after a later step (applied or skipped, not
        a micro-step) when the heap has grown (glibc's ``malloc_trim``; the rule is
        zero_core.memory.host_heap.StepHeapRelease): without it, resident memory can grow step
        after step with pages the allocator holds but nobody uses. Steps that reuse the
        heap as it is do not release, since each released page costs
        a fault when touched again. A no-op with another C library.
    reduce_dtype: the dtype gradients are reduced (all-reduced at stage 0, reduce-scattered
        at stages 1-3) and accumulated in: None (the default) reduces in ``param_dtype``;
        float32 (or "fp32") with bfloat16 or float16 compute casts each gradient into
        float32 buffers as it lands, so the sum over ranks and micro-steps rounds once per
        addition in float32 instead of in the compute dtype (FSDP2's
        ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``). It costs twice the gradient
        buffers' bytes and twice the gradient traffic (docs/precision.md). At stages 0 and 1
        ``p.grad`` is then None after backward, as at stages 2 and 3: a float32 buffer
        cannot be a bfloat16 parameter's ``.grad``.
    optimizer_in_backward: stage 3: step each gradient bucket's slice of the optimizer as
        soon as backward has reduced it, then free that slice, so no rank ever holds its
        whole gradient shard: model states peak at 12 bytes per parameter / N instead of
        16 (float32 Adam), with the same bits. Needs nonfinite="raise" and no clipping,
        accumulation, float16 or offload (zero_core.optimizer_in_backward says why).
    delayed_parameter_update: ZeRO-Offload's one-step delayed parameter update (DPU): step
        t's optimizer update runs in a background thread on the host while forward and
        backward of step t+1 run with the parameters from before it (updates up to step
        t-1's gradients). Needs ``offload_optimizer`` "cpu" or "disk"; not with
        ``optimizer_in_backward``. ``save()`` waits for the update and publishes it, so a
        checkpoint holds every step taken (zero_core.delayed_update; docs/offload.md).
    shard_weights: stages 1-3 (issue 52): one weight per data-parallel rank; each rank's
        share of the sharded model states (float32 masters, optimizer states, gradient
        shard, stage 3's parameter shard) is proportional to its weight, on 128-element
        boundaries, with the same bits as even shards (zero_core.uneven_shards). The
        collectives still move N equal chunks of the largest share. At stage 0 nothing is
        sharded and the weights change nothing. None: even shards.
    micro_batches_per_rank: virtual ranks (zero_core.virtual_ranks): data-parallel rank i
        runs c_i = micro_batches_per_rank[i] micro-batches (backward calls) per micro-step,
        and the run equals the homogeneous one at sum(c) ranks bit for bit. A list becomes
        a tuple; it must hold one int >= 1 per data-parallel rank. "auto" must be
        resolved first (zero_core.hetero.choose_micro_batches, or zero-train's profiler).
        None: one micro-batch per rank.
    """

    stage: int = DEFAULT_STAGE
    param_dtype: torch.dtype = torch.float32
    bucket_numel: int = 2**22
    gradient_accumulation_steps: int = 1
    clip_grad_norm: float | None = None
    loss_scale: float = 0.0
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    max_buckets_in_flight: int = 2
    coalesce_numel: int | None = None
    overlap_comm: bool = True
    prefetch_numel: int = DEFAULT_PREFETCH_NUMEL
    gather_coalesce_numel: int = DEFAULT_GATHER_COALESCE_NUMEL
    max_live_numel: int = 2**28
    keep_backward_head: bool = True
    backward_head_numel: int = DEFAULT_BACKWARD_HEAD_NUMEL
    persistence_threshold: int = 2**12
    allow_untested_optimizer: bool = False
    nonfinite: str = "skip"
    cast_forward_inputs: bool = True
    offload_optimizer: str = "none"
    offload_params: str = "none"
    offload_dir: str | None = None
    offload_fraction: float = 1.0
    offload_sub_group_numel: int = 2**22
    offload_buffer_count: int = 4
    offload_io_threads: int = 4
    offload_pin_memory: bool = True
    offload_gradients: bool = True
    shard_group_size: int | None = None
    hierarchical_gather: bool = False
    hpz_partition_size: int = 1
    quantize_weights: bool = False
    quantize_gradients: str | bool | None = None
    allow_quantize_fallback: bool = False
    release_host_heap: bool = True
    optimizer_in_backward: bool = False
    reduce_dtype: torch.dtype | None = None
    delayed_parameter_update: bool = False
    shard_weights: tuple[float, ...] | Literal["auto"] | None = None
    micro_batches_per_rank: CountsSetting = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_weights", normalise_shard_weights(self.shard_weights))
        counts = normalise_counts("micro_batches_per_rank", self.micro_batches_per_rank)
        object.__setattr__(self, "micro_batches_per_rank", counts)
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _reduce_dtype(self.reduce_dtype, self.param_dtype))
        self._check_offload()
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (
            0, 1, 2, 3,
        ):  # fmt: skip
            raise ValueError(f"stage={self.stage!r}: ZeRO stages are 0, 1, 2 and 3")
        self._check_hierarchy()
        for name in ("bucket_numel", "gradient_accumulation_steps", "loss_scale_window",
                     "hysteresis", "max_buckets_in_flight"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
                raise ValueError(f"{name}={value!r} must be a number")
        for name in (
            "prefetch_numel", "max_live_numel", "backward_head_numel", "persistence_threshold",
            "coalesce_numel", "gather_coalesce_numel",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "coalesce_numel":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.clip_grad_norm is not None and not isinstance(self.clip_grad_norm, int | float):
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r} must be a number or None")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite={self.nonfinite!r} must be 'skip' or 'raise'")
        for name in (
            "allow_untested_optimizer", "cast_forward_inputs", "overlap_comm", "release_host_heap",
            "optimizer_in_backward", "keep_backward_head",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.clip_grad_norm is not None and not (
            math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0
        ):
            raise ValueError(
                f"clip_grad_norm={self.clip_grad_norm!r} must be a positive number, or None "
                "to disable clipping"
            )
        if self.loss_scale < 0:
            raise ValueError(f"loss_scale={self.loss_scale!r}: use 0 for dynamic, > 0 for fixed")
        if not self.initial_loss_scale >= self.min_loss_scale > 0:
            raise ValueError(
                f"need initial_loss_scale ({self.initial_loss_scale}) >= min_loss_scale "
                f"({self.min_loss_scale}) > 0"
            )
        if self.loss_scale and self.param_dtype is not torch.float16:
            raise ValueError("loss_scale applies to param_dtype=float16 only; remove it")
        delayed = delayed_update_error(self)  # first: it names optimizer_in_backward itself
        if delayed:
            raise ValueError(delayed)
        fused = optimizer_in_backward_error(self)
        if fused:
            raise ValueError(fused)
        uneven = shard_weights_error(self)
        if uneven:
            raise ValueError(uneven)

    def _check_offload(self) -> None:
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: use one of {', '.join(OFFLOAD_DEVICES)}"
                )
        for name in ("offload_sub_group_numel", "offload_io_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        count = self.offload_buffer_count
        if not isinstance(count, int) or isinstance(count, bool) or count < 3:
            raise ValueError(
                f"offload_buffer_count={count!r} must be an integer >= 3 (one sub-group "
                "read, one stepped and one written back at once)"
            )
        fraction = self.offload_fraction
        if (
            not isinstance(fraction, int | float)
            or isinstance(fraction, bool)
            or not (0.0 <= fraction <= 1.0)
        ):
            raise ValueError(f"offload_fraction={fraction!r} must be a number in [0, 1]")
        for name in ("offload_pin_memory", "offload_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        wrong_stage = offload_stage_error(self.stage, self.offload_optimizer, self.offload_params)
        if wrong_stage:
            raise ValueError(wrong_stage)
        disk = "disk" in (self.offload_optimizer, self.offload_params)
        if disk and not self.offload_dir:
            raise ValueError(
                "offloading to 'disk' needs offload_dir: the folder for the swap files "
                "(zero-train: --offload-dir; DeepSpeed: nvme_path)"
            )
        if self.offload_dir is not None and not isinstance(self.offload_dir, str):
            object.__setattr__(self, "offload_dir", str(self.offload_dir))

    @property
    def coalesce_limit(self) -> int:
        """``coalesce_numel``, or where unset its default for this configuration's gradient
        reduction (qgZ or exact)."""
        if self.coalesce_numel is not None:
            return self.coalesce_numel
        return QGZ_COALESCE_NUMEL if self.quantize_gradients else DEFAULT_COALESCE_NUMEL

    @property
    def gradient_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced and accumulated in: ``reduce_dtype``, or the
        compute dtype where that is None."""
        return self.param_dtype if self.reduce_dtype is None else self.reduce_dtype

    @property
    def gradients_offloaded(self) -> bool:
        """Whether reduced gradient slices leave the device (``offload_gradients`` with an
        offloaded optimizer at stage 2 or 3)."""
        return self.offload_gradients and self.offload_optimizer != "none" and self.stage >= 2

    @property
    def offloads(self) -> bool:
        """Whether any model state lives outside the device."""
        return self.offload_optimizer != "none" or self.offload_params != "none"

    def _check_hierarchy(self) -> None:
        """Issue 16's settings: sizes are checked against the world in the engine."""
        if self.shard_group_size == -1:
            object.__setattr__(self, "shard_group_size", None)
        size = self.shard_group_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"shard_group_size={size!r} must be a number of ranks >= 1 (None or -1: all)"
            )
        hpz = self.hpz_partition_size
        if not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1:
            raise ValueError(f"hpz_partition_size={hpz!r} must be an integer >= 1 (1: off)")
        grads = self.quantize_gradients
        grads = "int4" if grads is True else None if grads is False else grads
        if grads not in (None, "int4", "int8"):
            raise ValueError(
                f"quantize_gradients={self.quantize_gradients!r}: use 'int4', 'int8' or None"
            )
        object.__setattr__(self, "quantize_gradients", grads)
        wanted = [
            name
            for name, on, least in (
                ("shard_group_size", size is not None, 1),
                ("hpz_partition_size", hpz > 1, 3),
                ("hierarchical_gather", self.hierarchical_gather, 3),
                ("quantize_weights", self.quantize_weights, 3),
                ("quantize_gradients", grads is not None, 2),
            )
            if on and self.stage < least
        ]
        if wanted:
            raise ValueError(
                f"{', '.join(wanted)} at stage {self.stage}: hybrid sharding needs stage 1 or "
                "more, qgZ stage 2 or more, hpZ, qwZ and hierarchical gathers stage 3; raise "
                "the stage or turn them off"
            )

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any]) -> ZeroConfig:
        """The engine's settings from a DeepSpeed config dict; an unknown key is an error
        that names it. Batch sizes, the optimizer and the scheduler are the training
        loop's: ``zero_core.read_deepspeed`` reads the whole config, these included."""
        for key in TRAINER_KEYS:
            if key in config:
                raise ValueError(
                    f"DeepSpeed config key {key!r} configures the training loop, not the "
                    "engine: read the config with zero_core.read_deepspeed (or pass it "
                    "whole to zero_core.initialize(model, config=...))"
                )
        return cls(**translate_deepspeed(config)[0])
