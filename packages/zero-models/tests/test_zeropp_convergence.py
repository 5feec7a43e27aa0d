"""ZeRO++ converges like exact ZeRO-3 (issue 16, item 6): the default GPT, trained by
zero-train for STEPS steps on 4 ranks as 2 nodes x 2 (ZERO_RANKS_PER_NODE=2), ends with a
loss within 1% of the unquantized stage-3 run's, with all of ZeRO++ on (hpZ over a node,
qwZ's int8 weight gathers, qgZ's int4 gradient reduction across both nodes).

"Final loss" is the mean of the last FINAL_WINDOW steps' losses: one step's loss is one
batch's, and batches differ by more than the 1% asked for; both runs see the same batches,
so the window compares like with like. Runs are deterministic (--threads 1), so the result
is a fixed number, not a flaky one; a loaded machine changes only the wall time.

Measured (200 steps; exact run 2.3222; relative to it): int4 +0.71% (gradient blocks of
128; +1.70% with 512), int8 +0.91%. Exact runs with the learning rate moved by 1e-4
relative end +0.45% and +0.87%: a single run pair resolves differences of about 1%, no
finer, so the bound here is the issue's 1%, not tighter. int8 is left out: a third run
would take the test past 10 minutes of 2 cores, and tells no more (it ends further from the
exact run than int4, its error being under a tenth of int4's).

Measured again on 2026-12-03 (AMD EPYC, same exact run 2.3222): all of ZeRO++ +1.41%, so
this test FAILS there, at 5198df2 as at later commits. Parts alone: qgZ int4 +0.59%; qwZ
+1.41% with its 2048-element blocks, +0.23% with 256, +1.37% with 64. The gap does not
shrink with the quantization error (64-element blocks err less than 256-element ones), so
one run pair measures the trajectories' divergence, about +-1%, as much as the codec: the
1% bound needs an estimate over several seeds, or a longer run, before it can pass or
fail for a reason (issue 16's note).

Slow (nox -s slow): two runs of the small preset, about 12 CPU-minutes in all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zero_models.run_metrics import read_metrics

STEPS = 200
FINAL_WINDOW = 20
TOLERANCE = 0.01  # relative, on the final loss: the bound (DeepSpeed tests 10%)
RANKS, RANKS_PER_NODE = 4, 2
RUN_TIMEOUT_S = 900  # one zero-train run, on a loaded 2-core machine
ZEROPP = ("--hpz", str(RANKS_PER_NODE), "--quantize-weights", "--quantize-gradients", "int4")


def train(out: Path, *extra: str) -> list[dict[str, Any]]:
    """Run zero-train (default GPT, stage 3, 4 ranks as 2 nodes x 2) into ``out``; its
    per-step records."""
    env = dict(os.environ, ZERO_RANKS_PER_NODE=str(RANKS_PER_NODE))
    command = [sys.executable, "-m", "zero_models.train", "--model", "small", "--stage", "3",
               "--nproc", str(RANKS), "--steps", str(STEPS), "--threads", "1",
               "--sample-tokens", "4", "--out", str(out), *extra]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            env=env, cwd=out.parent)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    _, records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    return records


def final_loss(records: list[dict[str, Any]]) -> float:
    return float(sum(r["loss"] for r in records[-FINAL_WINDOW:])) / FINAL_WINDOW


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_zeropp_final_loss_within_one_percent_of_stage_3(tmp_path: Path) -> None:
    exact_run = train(tmp_path / "stage3")
    zeropp_run = train(tmp_path / "zeropp", *ZEROPP)
    exact, lossy = final_loss(exact_run), final_loss(zeropp_run)
    # The comparison means something only if training went somewhere: the small GPT starts
    # near ln(256) = 5.5 and must have learnt well below it.
    assert exact < 0.5 * exact_run[0]["loss"], (exact, exact_run[0]["loss"])
    # ZeRO++ ran: qgZ and qwZ cut the bytes between the nodes (issue 16's 0.3x goal).
    exact_bytes, zeropp_bytes = (r[-1]["inter_node_bytes"] for r in (exact_run, zeropp_run))
    assert 0 < zeropp_bytes < 0.3 * exact_bytes, (zeropp_bytes, exact_bytes)
    assert abs(lossy - exact) <= TOLERANCE * exact, (
        f"final loss {lossy:.4f} with ZeRO++ vs {exact:.4f} exact, "
        f"{(lossy - exact) / exact:+.2%} (bound {TOLERANCE:.0%})"
    )
