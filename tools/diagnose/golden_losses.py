#!/usr/bin/env python
"""Write the golden loss file of the default zero-train run from a run's metrics.

    zero-train --threads 1 --out /tmp/golden          # the README's run, 600 steps
    python -m tools.diagnose.golden_losses /tmp/golden/metrics.jsonl

writes packages/zero-models/tests/golden/default_run.txt: a header with what the bits
depend on (the run record of zero_models.run_metrics: fingerprint, corpus digest, options),
then one line per step, ``STEP LOSS`` with the loss printed exactly (repr of the float).
packages/zero-models/tests/test_golden_losses.py checks a prefix of it against a fresh run,
and the README's quick-start figures against it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zero_models.golden import GoldenRun, write_golden
from zero_models.run_metrics import read_metrics

REPOSITORY = Path(__file__).resolve().parents[2]
GOLDEN_FILE = REPOSITORY / "packages/zero-models/tests/golden/default_run.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="RUN/metrics.jsonl of one uninterrupted run")
    parser.add_argument("--out", type=Path, default=GOLDEN_FILE)
    args = parser.parse_args()
    runs, steps = read_metrics(args.metrics)
    if len(runs) != 1 or runs[0]["first_step"] != 0:
        sys.exit(f"{args.metrics}: not one run from step 0 (resumed runs are not golden)")
    run = runs[0]
    argv = list(run["argv"])
    if "--stop-after" in argv:
        sys.exit(f"{args.metrics}: a run cut off with --stop-after is not golden")
    if "--out" in argv:  # where it wrote is not part of what it computed
        del argv[argv.index("--out") : argv.index("--out") + 2]
    golden = GoldenRun(
        fingerprint=run["fingerprint"],
        corpus=run["corpus"],
        argv=argv,
        losses=[float(record["loss"]) for record in steps],
    )
    write_golden(args.out, golden)
    print(f"wrote {args.out}: {len(golden.losses)} steps, run record {json.dumps(run)}")


if __name__ == "__main__":
    main()
