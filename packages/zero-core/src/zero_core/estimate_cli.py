"""``zero-estimate``: per-rank model-state memory of every ZeRO stage.

zero-estimate --params 7.5e9 --world-size 64
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .memory_estimate import STAGES, model_state_bytes

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# float32 bytes per parameter an optimizer keeps, besides the fp32 master copy (4).
OPTIMIZER_STATE_BYTES = {
    "adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4, "rmsprop": 4,
}  # fmt: skip


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
        help="sets K = 4 (fp32 master) + the optimizer's fp32 states",
    )  # fmt: skip
    parser.add_argument(
        "--optimizer-state-bytes", "-K", type=float, default=None,
        help="K directly: optimizer state bytes per parameter (overrides --optimizer)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.params < 0 or args.world_size < 1:
        parser.error("--params must be >= 0 and --world-size >= 1")
    k = args.optimizer_state_bytes
    if k is None:
        k = 4 + OPTIMIZER_STATE_BYTES[args.optimizer]
    width = DTYPE_BYTES[args.dtype]
    rows = {
        stage: model_state_bytes(
            args.params, args.world_size, stage,
            optimizer_state_bytes=k, param_bytes=width, grad_bytes=width,
        )
        for stage in STAGES
    }  # fmt: skip
    if args.json:
        print(json.dumps({str(s): {**r._asdict(), "total": r.total} for s, r in rows.items()}))
        return
    print(
        f"model states per rank, Ψ={args.params:.4g}, N={args.world_size}, "
        f"{args.dtype} parameters and gradients, K={k:g}"
    )
    for stage, row in rows.items():
        print(f"  stage {stage} {STAGE_NAMES[stage]:9s} {row.total / 1e9:10.1f} GB")


if __name__ == "__main__":
    main()
