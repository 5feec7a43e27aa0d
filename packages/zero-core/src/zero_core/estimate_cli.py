"""``zero-estimate``: per-rank model-state memory of every ZeRO stage.

zero-estimate --params 7.5e9 --world-size 64
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .memory_estimate import ADAM_STATE_BYTES, STAGES, model_state_bytes

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zero-estimate", description=__doc__)
    parser.add_argument("--params", type=float, required=True, help="parameter count Ψ")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--optimizer-state-bytes", "-K", type=float, default=ADAM_STATE_BYTES,
        help="optimizer state bytes per parameter, K (mixed-precision Adam: 12)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = {
        stage: model_state_bytes(
            args.params, args.world_size, stage, optimizer_state_bytes=args.optimizer_state_bytes
        )
        for stage in STAGES
    }
    if args.json:
        print(json.dumps({str(s): {**r._asdict(), "total": r.total} for s, r in rows.items()}))
        return
    print(
        f"model states per rank, Ψ={args.params:.4g}, N={args.world_size}, "
        f"K={args.optimizer_state_bytes:g}"
    )
    for stage, row in rows.items():
        print(f"  stage {stage} {STAGE_NAMES[stage]:9s} {row.total / 1e9:10.1f} GB")


if __name__ == "__main__":
    main()
