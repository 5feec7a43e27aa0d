"""``zero-estimate``: per-rank memory of every ZeRO stage: model states on the device, in
host memory and on disk (offload tiers), and with a model shape, the activations of one
step (zero_core.estimate.activations).

zero-estimate --params 7.5e9 --world-size 64
zero-estimate --params 7.5e9 --world-size 64 --offload-optimizer disk --offload-params cpu
zero-estimate --params 124e6 --world-size 4 --dtype fp32 --layers 12 --width 768 --heads 12 \
    --vocab-size 50257 --tokens 1024 --checkpoint partitioned --tp 2
zero-estimate --params 7.5e9 --world-size 64 --ranks-per-node 8 --hpz 8 --quantize-weights \
    --quantize-gradients int4
zero-estimate --params 1.3e9 --world-size 8 --dtype bf16 --reduce-dtype fp32 --ranks-per-node 8
zero-estimate --params 13e9 --world-size 1 --dtype fp16 --offload-optimizer cpu

With offload tiers, gradients follow the optimizer's tier at stages 2 and 3 (as
ZeroConfig.offload_gradients does; --no-offload-gradients keeps them on the device), and
every stage's row also gives the device's working memory (zero_core.estimate.working_set:
the gradient buckets in flight and stage 3's gathered units; with a model shape, its
largest parameter and unit) and the bytes one step moves per rank between device and host
and between host and disk (zero_core.estimate.offload_traffic).

With --ranks-per-node, every stage's row also gives the bytes one step sends per rank over
intra-node and inter-node links (zero_core.estimate.link_traffic; zero_comm's ring convention). At
stage 3 forward keeps backward's first buckets gathered (--backward-head-numel, as the
engine's default): backward does not gather those again, so the figure is under the
paper's 3Ψ(N-1)/N unless --no-backward-head.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from ..command_line import CommandLineParser
from ..config.choices import SHORT_DTYPE_NAMES
from ..config.zero_config import (
    DEFAULT_BACKWARD_HEAD_NUMEL,
    DEFAULT_GATHER_COALESCE_NUMEL,
    DEFAULT_PREFETCH_NUMEL,
    ZeroConfig,
)
from ..hybrid_sharding import hierarchy_sizes
from .activations import (
    ActivationBytes,
    TransformerShape,
    activation_bytes,
    shape_problem,
)
from .link_traffic import backward_head_buckets, even_buckets, step_link_bytes
from .model_states import (
    OPTIMIZER_STATE_BYTES,
    STAGES,
    TIERS,
    model_state_bytes,
    state_bytes_per_param,
    tiered_state_bytes,
)
from .offload_traffic import offload_traffic
from .table import print_table
from .uneven import parse_weights, per_rank_rows, print_per_rank
from .working_set import transformer_largest, working_bytes

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandLineParser(prog="zero-estimate", description=__doc__)
    parser.add_argument("--params", type=float, required=True, help="parameter count Ψ")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="fp16",
        help="compute dtype of parameters and gradients (default fp16)",
    )  # fmt: skip
    parser.add_argument(
        "--reduce-dtype", choices=sorted(DTYPE_BYTES),
        help="dtype gradients are reduced and held in (ZeroConfig.reduce_dtype; default "
        "--dtype's): fp32 with 16-bit --dtype counts 4-byte gradients and gradient traffic",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adam",
        help="sets K = 4 (fp32 master, not with --dtype fp32) + the optimizer's fp32 states",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer-state-bytes", "-K", type=float, default=None,
        help="K directly: optimizer state bytes per parameter (overrides --optimizer)",
    )  # fmt: skip
    shape = parser.add_argument_group("activations (all five, or none)")
    for name, what in (
        ("layers", "transformer blocks"),
        ("width", "hidden size"),
        ("heads", "attention heads"),
        ("vocab-size", "vocabulary"),
        ("tokens", "tokens per rank per micro-step: micro-batch x sequence"),
    ):
        shape.add_argument(f"--{name}", type=int, help=what)  # fmt: skip
    shape.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    shape.add_argument(
        "--checkpoint", choices=("none", "full", "partitioned"), default="none",
        help="activation checkpointing of the blocks; partitioned = P_a over --tp",
    )  # fmt: skip
    tiers = parser.add_argument_group("offload tiers (ZeRO-Offload / ZeRO-Infinity)")
    tiers.add_argument(
        "--offload-optimizer", choices=TIERS, default="none",
        help="stages 1-3: float32 masters and optimizer states in host memory or on disk",
    )  # fmt: skip
    tiers.add_argument(
        "--offload-params", choices=TIERS, default="none",
        help="stage 3: the compute-parameter shards in host memory or on disk",
    )  # fmt: skip
    tiers.add_argument(
        "--offload-fraction", type=float, default=1.0,
        help="fraction of the masters and optimizer states in the tier (default 1)",
    )  # fmt: skip
    tiers.add_argument(
        "--offload-sub-group-numel", type=int, default=2**22,
        help="elements per disk-tier sub-group (tile; default 2**22)",
    )  # fmt: skip
    tiers.add_argument(
        "--offload-buffer-count", type=int, default=4,
        help="disk-tier pipeline buffers in host memory (default 4)",
    )  # fmt: skip
    tiers.add_argument(
        "--bucket-numel", type=int, default=2**22,
        help="elements per bucket: a tile is at most a bucket slice (default 2**22)",
    )  # fmt: skip
    tiers.add_argument(
        "--prefetch-numel", type=int, default=DEFAULT_PREFETCH_NUMEL,
        help="stage 3: elements gathered ahead; disk-tier parameters are read as many more "
        "ahead, into host buffers (default 2**22)",
    )  # fmt: skip
    tiers.add_argument(
        "--clip", action="store_true",
        help="clip_grad_norm is set: the norm reads offloaded gradients once more per step",
    )  # fmt: skip
    tiers.add_argument(
        "--no-offload-gradients", action="store_true",
        help="stages 2-3: keep the gradient shard on the device, not in the optimizer's tier "
        "(ZeroConfig.offload_gradients=False)",
    )  # fmt: skip
    working = parser.add_argument_group("device working memory (bounded buffers)")
    working.add_argument(
        "--max-buckets-in-flight", type=int, default=ZeroConfig.max_buckets_in_flight,
        help="gradient reduce-scatters outstanding at once (default %(default)s)",
    )  # fmt: skip
    working.add_argument(
        "--max-live-numel", type=int, default=ZeroConfig.max_live_numel,
        help="stage 3: most elements gathered at once by prefetching (default 2**28)",
    )  # fmt: skip
    working.add_argument(
        "--gather-coalesce-numel", type=int, default=DEFAULT_GATHER_COALESCE_NUMEL,
        help="stage 3: elements of one coalesced all-gather (default 2**18)",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer-in-backward", action="store_true",
        help="stage 3: the optimizer stepped in backward bucket by bucket "
        "(ZeroConfig.optimizer_in_backward): one bucket slice of gradients held, not Ψ/N",
    )  # fmt: skip
    links = parser.add_argument_group("communication per link class (issue 16)")
    links.add_argument(
        "--ranks-per-node", type=int,
        help="ranks per node (consecutive): report each step's intra-/inter-node bytes",
    )  # fmt: skip
    links.add_argument(
        "--shard-group", type=int, help="stages 1-3: hybrid sharding over groups of this size"
    )
    links.add_argument("--hpz", type=int, default=1, help="stage 3: hpZ group size (1: off)")
    links.add_argument(
        "--quantize-weights", action="store_true", help="stage 3: qwZ int8 parameter gathers"
    )
    links.add_argument(
        "--quantize-gradients", choices=("int4", "int8"), help="stages 2-3: qgZ gradients"
    )
    links.add_argument(
        "--backward-head-numel", type=int, default=DEFAULT_BACKWARD_HEAD_NUMEL,
        help="stage 3: elements past backward's first bucket that forward keeps gathered "
        "for backward, which then does not gather them again (ZeroConfig."
        "backward_head_numel; default 2**24)",
    )  # fmt: skip
    links.add_argument(
        "--no-backward-head", action="store_true",
        help="stage 3: release every unit after its forward (keep_backward_head=False): the "
        "paper's 3Ψ(N-1)/N, every bucket gathered twice",
    )  # fmt: skip
    links.add_argument(
        "--accumulation", type=int, default=1,
        help="micro-steps per step: gradients (and stage 3's gathers) go once per micro-step",
    )  # fmt: skip
    links.add_argument(
        "--native-sums", action="store_true",
        help="a native (not deterministic) communicator: hybrid sharding sums the replicas "
        "once per step when accumulating (MiCS), not per micro-step",
    )  # fmt: skip
    parser.add_argument(
        "--shard-weights", type=parse_weights, default=None,
        help="one weight per rank, like 2,1 (ZeroConfig.shard_weights): add each rank's "
        "model-state bytes, its share of the sharded states following its weight",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.shard_weights is not None and len(args.shard_weights) != args.world_size:
        parser.error(
            f"--shard-weights has {len(args.shard_weights)} weights for --world-size "
            f"{args.world_size}: give one per rank"
        )
    if not 0 <= args.params < math.inf or args.world_size < 1:
        parser.error("--params must be a number >= 0 and --world-size >= 1")
    k_given = args.optimizer_state_bytes
    if k_given is not None and not 0 <= k_given < math.inf:
        parser.error(f"-K {k_given} must be a number of bytes >= 0")
    if args.accumulation < 1:
        parser.error(f"--accumulation {args.accumulation} must be at least 1")
    try:  # the engine's own rule: the compute dtype or a wider one
        ZeroConfig(param_dtype=args.dtype, reduce_dtype=args.reduce_dtype)
    except ValueError as exc:
        parser.error(f"--reduce-dtype: {exc}")
    grad_width = DTYPE_BYTES[args.reduce_dtype or args.dtype]
    if args.optimizer_in_backward:
        try:  # the engine's own refusal (fp16's loss scaling, the tiers)
            ZeroConfig(
                stage=3, optimizer_in_backward=True, nonfinite="raise", clip_grad_norm=None,
                param_dtype=SHORT_DTYPE_NAMES[args.dtype], offload_optimizer=args.offload_optimizer,
                offload_params=args.offload_params,
                offload_dir="/" if "disk" in (args.offload_optimizer, args.offload_params)
                else None,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(f"--optimizer-in-backward: {exc}")
    if args.ranks_per_node is None and (
        args.shard_group or args.hpz > 1 or args.quantize_weights or args.quantize_gradients
    ):
        args.ranks_per_node = args.world_size  # one node unless told
    if not 0 <= args.offload_fraction <= 1:
        parser.error(f"--offload-fraction must be in [0, 1], got {args.offload_fraction}")
    if min(args.offload_sub_group_numel, args.offload_buffer_count, args.bucket_numel) < 1:
        parser.error("--offload-sub-group-numel, --offload-buffer-count, --bucket-numel: >= 1")
    if args.prefetch_numel < 0:
        parser.error(f"--prefetch-numel must be >= 0, got {args.prefetch_numel}")
    if args.max_buckets_in_flight < 1:
        parser.error(f"--max-buckets-in-flight must be >= 1, got {args.max_buckets_in_flight}")
    if min(args.max_live_numel, args.gather_coalesce_numel) < 0:
        parser.error("--max-live-numel and --gather-coalesce-numel must be >= 0")
    if args.backward_head_numel < 0:
        parser.error(f"--backward-head-numel must be >= 0, got {args.backward_head_numel}")
    sizes = [args.layers, args.width, args.heads, args.vocab_size, args.tokens]
    activations: ActivationBytes | None = None
    if any(v is not None for v in sizes):
        if any(v is None or v < 1 for v in sizes) or args.tp < 1:
            parser.error("give all of --layers --width --heads --vocab-size --tokens, each >= 1, "
                         "and --tp >= 1")  # fmt: skip
        problem = shape_problem(TransformerShape(*sizes), args.tp)
        if problem:
            parser.error(problem)
        activations = activation_bytes(
            TransformerShape(*sizes), tp=args.tp, checkpoint=args.checkpoint,
            dtype_bytes=DTYPE_BYTES[args.dtype],
        )  # fmt: skip
    elif args.tp != 1 or args.checkpoint != "none":
        parser.error("--tp and --checkpoint shape the activations: give --layers --width "
                     "--heads --vocab-size --tokens too")  # fmt: skip
    k = args.optimizer_state_bytes
    if k is None:
        k = state_bytes_per_param(DTYPE_BYTES[args.dtype], args.optimizer)
    width = DTYPE_BYTES[args.dtype]
    if width != 4 and k < 4 and args.offload_optimizer != "none":
        parser.error(f"-K {k:g} has no room for the 4-byte float32 master of {args.dtype}")
    # A transformer's largest parameter and fetch unit: its embedding or its MLP's linear.
    largest, unit = (0.0, 0.0)
    if activations is not None:
        largest, unit = transformer_largest(args.vocab_size, args.width, args.tp)
    if args.ranks_per_node is not None:
        problem = _link_options_error(args)
        if problem:
            parser.error(problem)
    _check_hierarchy(parser, args)
    rows = {stage: _row(args, stage, k, width, grad_width, largest) for stage in STAGES}
    for stage, row in rows.items():
        row.update(_offload_row(args, stage, k, width, grad_width, largest, unit))
        row["device_peak"] = row["device"] + row["working"]
    if args.ranks_per_node is not None:
        for stage, row in rows.items():
            row.update(_link_row(args, stage, width, grad_width))
    if args.shard_weights is not None:
        for stage, row in rows.items():
            row["ranks"] = per_rank_rows(
                args, stage, lambda a, s: _row(a, s, k, width, grad_width, largest)
            )
    if args.json:
        table = {str(s): row for s, row in rows.items()}
        if activations is not None:
            for entry in table.values():
                entry.update(activations_kept=activations.kept, activations_peak=activations.peak,
                             step_peak=entry["device_peak"] + activations.peak)  # fmt: skip
        print(json.dumps(table))
        return
    print_table(args, k, rows, activations)
    if args.shard_weights is not None:
        print_per_rank(rows)


def _row(
    args: argparse.Namespace, stage: int, k: float, width: int, grad_width: int, largest: float
) -> dict[str, Any]:
    """One stage's bytes: the paper's categories over every tier (``total``), and where
    they are; the tiers this stage cannot apply are dropped (stage 0 never offloads,
    parameters only at stage 3), and where it applies none of those asked for, host and
    disk are None (n/a)."""
    optimizer = args.offload_optimizer if stage >= 1 else "none"
    params = args.offload_params if stage == 3 else "none"
    # Hybrid sharding partitions over the shard group; hpZ adds its secondary copy.
    shards = args.shard_group if stage >= 1 and args.shard_group else args.world_size
    secondary = width * args.params / args.hpz if stage == 3 and args.hpz > 1 else 0.0
    tiered = tiered_state_bytes(
        args.params, shards, stage, optimizer_state_bytes=k, param_bytes=width,
        grad_bytes=grad_width, offload_optimizer=optimizer, offload_params=params,
        offload_fraction=args.offload_fraction, sub_group_numel=args.offload_sub_group_numel,
        buffer_count=args.offload_buffer_count, bucket_numel=args.bucket_numel,
        largest_param_numel=largest, prefetch_numel=args.prefetch_numel,
        optimizer_in_backward=args.optimizer_in_backward,
        offload_gradients=not args.no_offload_gradients,
    )  # fmt: skip
    plain = model_state_bytes(
        args.params, shards, stage, optimizer_state_bytes=k, param_bytes=width,
        grad_bytes=grad_width,
    )  # fmt: skip
    parameters = plain.parameters  # in whichever tier
    # One bucket slice with optimizer_in_backward at stage 3; float32 where offloaded.
    gradients = tiered.gradients + tiered.tier_gradients
    optimizer_states = tiered.model_states - parameters - gradients  # + separate masters
    asked = args.offload_optimizer != "none" or args.offload_params != "none"
    applies = optimizer != "none" or params != "none"
    na = asked and not applies
    return {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer_states": optimizer_states,
        "total": tiered.model_states + secondary,
        "device": tiered.device + secondary,
        "hpz_secondary": secondary,
        "host": None if na else tiered.host_resident,
        "disk": None if na else tiered.disk,
        "staging": None if na else tiered.staging,
        "read_ahead": None if na else tiered.read_ahead,
        "offload_optimizer": optimizer,
        "offload_params": params,
        "tier_gradients": tiered.tier_gradients,
        "gradients_tier": optimizer if tiered.tier_gradients else "none",
    }


def _offload_row(
    args: argparse.Namespace, stage: int, k: float, width: int, grad_width: int,
    largest: float, unit: float,
) -> dict[str, Any]:  # fmt: skip
    """One stage's device working memory (``working``; ``device_peak`` adds it to the
    device's model states) and its bytes per step over the offload links (``links``)."""
    shards = args.shard_group if stage >= 1 and args.shard_group else args.world_size
    head = 0 if args.no_backward_head else args.backward_head_numel
    held = working_bytes(
        stage, shards, param_bytes=width, grad_bytes=grad_width, bucket_numel=args.bucket_numel,
        max_buckets_in_flight=args.max_buckets_in_flight, largest_param_numel=largest,
        largest_unit_numel=unit, prefetch_numel=args.prefetch_numel,
        max_live_numel=args.max_live_numel, backward_head_numel=head,
        gather_coalesce_numel=args.gather_coalesce_numel,
    )  # fmt: skip
    kept = 0
    if stage == 3 and not args.no_backward_head:
        buckets = even_buckets(args.params, args.bucket_numel, shards)
        kept = sum(backward_head_buckets(buckets, args.backward_head_numel))
    states = k - (0 if width == 4 else 4)  # s: the optimizer's own, the master apart
    traffic = offload_traffic(
        args.params, shards, stage, param_bytes=width, grad_bytes=grad_width,
        state_bytes=max(states, 0), offload_optimizer=args.offload_optimizer if stage else "none",
        offload_params=args.offload_params if stage == 3 else "none",
        offload_fraction=args.offload_fraction, offload_gradients=not args.no_offload_gradients,
        accumulation_steps=args.accumulation, backward_head_numel=kept, clipping=args.clip,
    )  # fmt: skip
    return {"working": held.total, "working_parts": held._asdict(), "links": traffic.as_dict()}


def _link_options_error(args: argparse.Namespace) -> str:
    """What is wrong with the link options ("" if nothing)."""
    n, per_node = args.world_size, args.ranks_per_node
    if per_node < 1 or n % per_node:
        return f"--ranks-per-node {per_node} must divide --world-size {n}"
    if args.accumulation < 1:
        return f"--accumulation {args.accumulation} must be at least 1"
    group = args.shard_group or n
    if group < 1 or n % group:
        return f"--shard-group {group} must divide --world-size {n}"
    if args.hpz < 1 or group % args.hpz:
        return f"--hpz {args.hpz} must divide the {group} ranks the parameters are sharded over"
    return ""


def _check_hierarchy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the engine refuses (its own check, hierarchy_sizes, at stage 3 where
    every option applies), and estimate an hpZ group as large as the shard group as hpZ
    off, as the engine runs it, saying so."""
    try:
        config = ZeroConfig(
            stage=3, shard_group_size=args.shard_group, hpz_partition_size=args.hpz,
            quantize_weights=args.quantize_weights, quantize_gradients=args.quantize_gradients,
        )  # fmt: skip
        sizes = hierarchy_sizes(config, args.world_size)
    except ValueError as exc:
        parser.error(f"--shard-group/--hpz/--quantize-*: {exc}")
    if sizes.note:
        print(f"zero-estimate: note: {sizes.note}", file=sys.stderr)
    args.hpz = sizes.hpz


def _link_row(args: argparse.Namespace, stage: int, width: int, grad_width: int) -> dict[str, Any]:
    """Per rank and step, the bytes sent within and across nodes at ``stage``, with the
    options that apply to it (hybrid sharding 1-3, qgZ 2-3, hpZ, qwZ and the backward
    head 3), and at stage 3 the elements of the backward head."""
    group = args.shard_group if stage >= 1 else None
    buckets = even_buckets(args.params, args.bucket_numel, group or args.world_size)
    kept: list[int] = []
    if stage == 3 and not args.no_backward_head:
        kept = backward_head_buckets(buckets, args.backward_head_numel)
    traffic = step_link_bytes(
        buckets, world_size=args.world_size, ranks_per_node=args.ranks_per_node, stage=stage,
        dtype_bytes=width, reduce_bytes=grad_width, shard_group_size=group,
        hpz_partition_size=args.hpz if stage == 3 else 1,
        quantize_weights=args.quantize_weights and stage == 3,
        quantize_gradients=args.quantize_gradients if stage >= 2 and not group else None,
        accumulation_steps=args.accumulation, deterministic=not args.native_sums,
        kept_bucket_numels=kept,
    )  # fmt: skip
    intra, inter = traffic.per_rank()
    return {"intra_node_bytes": intra, "inter_node_bytes": inter, "backward_head_numel": sum(kept)}


if __name__ == "__main__":
    main()
