"""ZeRO++ converges like exact ZeRO-3 (issue 16, item 6): the default GPT, trained by
zero-train for STEPS steps on 4 ranks as 2 nodes x 2 (ZERO_RANKS_PER_NODE=2), ends with a
loss within 1% of the unquantized stage-3 run's, with all of ZeRO++ on (hpZ over a node,
qwZ's int8 weight gathers, qgZ's int4 gradient reduction across both nodes).

"Final loss" is the mean of the last FINAL_WINDOW steps' losses: one step's loss is one
batch's, and batches differ by more than the 1% asked for; both runs see the same batches,
so the window compares like with like. Runs are deterministic (--threads 1), so the result
is a fixed number on a given machine, not a flaky one; a loaded machine changes only the
wall time.

One pair of runs cannot resolve 1%: two trajectories that start from the same values drift
apart by about that much whatever perturbs them. Measured on 2026-12-04 (AMD EPYC, 200
steps, final loss of ZeRO++ against the exact run of the same seed): seed 0 +1.41%, seed 1
-0.95%, seed 2 -0.17%; the exact runs alone span 2.3222-2.3516 (1.3%) over the seeds.
Earlier, exact runs with the learning rate moved by 1e-4 relative ended +0.45% and +0.87%
from the unmoved one, and qwZ with 64-element blocks ended further from the exact run than
with 256 (+1.37% against +0.23%) although it errs less. So the test compares the mean
final loss over SEEDS of each: at 2026-12-04 that is 2.3343 with ZeRO++ against 2.3321
exact, +0.09%. Three seeds narrow the drift, they do not remove it: the per-seed
differences above have a standard deviation of 1.2%, so their mean one of about 0.7%, and
another CPU (other bits, e.g. Intel's MKL) can land near the bound without a fault in
the codecs; more seeds narrow it further at 3 minutes each pair.

Slow (nox -s slow): six runs of the small preset, about 10 minutes on 2 cores
(82-105 s a run on 2026-12-04).
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
SEEDS = (0, 1, 2)
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
@pytest.mark.timeout(2 * len(SEEDS) * RUN_TIMEOUT_S + 60)
def test_zeropp_final_loss_within_one_percent_of_stage_3(tmp_path: Path) -> None:
    exact_losses, zeropp_losses, per_seed = [], [], []
    for seed in SEEDS:
        exact_run = train(tmp_path / f"stage3-{seed}", "--seed", str(seed))
        zeropp_run = train(tmp_path / f"zeropp-{seed}", *ZEROPP, "--seed", str(seed))
        exact, lossy = final_loss(exact_run), final_loss(zeropp_run)
        # The comparison means something only if training went somewhere: the small GPT
        # starts near ln(256) = 5.5 and must have learnt well below it.
        assert exact < 0.5 * exact_run[0]["loss"], (seed, exact, exact_run[0]["loss"])
        # ZeRO++ ran: qgZ and qwZ cut the bytes between the nodes (issue 16's 0.3x goal).
        exact_bytes, zeropp_bytes = (r[-1]["inter_node_bytes"] for r in (exact_run, zeropp_run))
        assert 0 < zeropp_bytes < 0.3 * exact_bytes, (seed, zeropp_bytes, exact_bytes)
        exact_losses.append(exact)
        zeropp_losses.append(lossy)
        per_seed.append(f"seed {seed}: {lossy:.4f} vs {exact:.4f} ({(lossy - exact) / exact:+.2%})")
    exact, lossy = sum(exact_losses) / len(SEEDS), sum(zeropp_losses) / len(SEEDS)
    assert abs(lossy - exact) <= TOLERANCE * exact, (
        f"mean final loss over seeds {SEEDS}: {lossy:.4f} with ZeRO++ vs {exact:.4f} exact, "
        f"{(lossy - exact) / exact:+.2%} (bound {TOLERANCE:.0%}); " + "; ".join(per_seed)
    )
