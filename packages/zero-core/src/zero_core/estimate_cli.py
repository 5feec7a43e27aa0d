"""``zero-estimate``: per-rank memory of every ZeRO stage: model states, and with a model
shape, the activations of one step (zero_core.activation_estimate).

zero-estimate --params 7.5e9 --world-size 64
zero-estimate --params 124e6 --world-size 4 --dtype fp32 --layers 12 --width 768 --heads 12 \
    --vocab-size 50257 --tokens 1024 --checkpoint partitioned --tp 2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .activation_estimate import ActivationBytes, TransformerShape, activation_bytes
from .memory_estimate import OPTIMIZER_STATE_BYTES, STAGES, model_state_bytes, state_bytes_per_param

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zero-estimate", description=__doc__)
    parser.add_argument("--params", type=float, required=True, help="parameter count Ψ")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="fp16",
        help="compute dtype of parameters and gradients (default fp16)",
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.params < 0 or args.world_size < 1:
        parser.error("--params must be >= 0 and --world-size >= 1")
    sizes = [args.layers, args.width, args.heads, args.vocab_size, args.tokens]
    activations: ActivationBytes | None = None
    if any(v is not None for v in sizes):
        if any(v is None or v < 1 for v in sizes) or args.tp < 1:
            parser.error("give all of --layers --width --heads --vocab-size --tokens, each >= 1, "
                         "and --tp >= 1")  # fmt: skip
        activations = activation_bytes(
            TransformerShape(*sizes), tp=args.tp, checkpoint=args.checkpoint,
            dtype_bytes=DTYPE_BYTES[args.dtype],
        )  # fmt: skip
    k = args.optimizer_state_bytes
    if k is None:
        k = state_bytes_per_param(DTYPE_BYTES[args.dtype], args.optimizer)
    width = DTYPE_BYTES[args.dtype]
    rows = {
        stage: model_state_bytes(
            args.params, args.world_size, stage,
            optimizer_state_bytes=k, param_bytes=width, grad_bytes=width,
        )
        for stage in STAGES
    }  # fmt: skip
    extra = activations.peak if activations is not None else 0.0
    if args.json:
        table = {str(s): {**r._asdict(), "total": r.total} for s, r in rows.items()}
        if activations is not None:
            for entry in table.values():
                entry.update(activations_kept=activations.kept, activations_peak=activations.peak,
                           step_peak=entry["total"] + activations.peak)  # fmt: skip
        print(json.dumps(table))
        return
    print(
        f"model states per rank, Ψ={args.params:.4g}, N={args.world_size}, "
        f"{args.dtype} parameters and gradients, K={k:g}"
    )
    for stage, row in rows.items():
        digits = 1 if activations is None else 3
        line = f"  stage {stage} {STAGE_NAMES[stage]:9s} {row.total / 1e9:10.{digits}f} GB"
        if activations is not None:
            line += f"  + activations {extra / 1e9:.3f} GB = {(row.total + extra) / 1e9:.3f} GB"
        print(line)
    if activations is not None:
        print(f"activations ({args.checkpoint} checkpointing, TP {args.tp}): "
              f"{activations.kept / 1e9:.3f} GB kept through forward, "
              f"{activations.peak / 1e9:.3f} GB at the step's peak")  # fmt: skip


if __name__ == "__main__":
    main()
