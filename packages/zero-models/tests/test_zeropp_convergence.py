"""ZeRO++ converges like exact ZeRO-3 (issue 16, item 6): the default GPT, trained by
zero-train for a few hundred steps on 4 ranks as 2 nodes x 2 (ZERO_RANKS_PER_NODE=2), ends
with a loss within 1% of the unquantized stage-3 run's, with all of ZeRO++ on (hpZ over a
node, qwZ's int8 weight gathers, qgZ's int4 or int8 gradient reduction across both nodes).

"Final loss" is the mean of the last FINAL_WINDOW steps' losses: one step's loss is one
batch's, and batches differ in difficulty by more than the 1% asked for; both runs see the
same batches, so the window compares like with like. Runs are deterministic (--threads 1:
the same bits on any machine with this torch), so the test is a fixed number, not a
flaky one; a loaded machine changes only its wall time.

Slow (nox -s slow): each run is STEPS steps of the small preset, about 2.5 minutes of two
cores; the unquantized run is made once for both parametrizations.
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
ZEROPP = ("--hpz", str(RANKS_PER_NODE), "--quantize-weights", "--quantize-gradients")


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


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return train(tmp_path_factory.mktemp("zeropp") / "stage3")


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("gradient_bits", ["int4", "int8"])
def test_zeropp_final_loss_within_one_percent_of_stage_3(
    gradient_bits: str, unquantized: list[dict[str, Any]], tmp_path: Path
) -> None:
    quantized = train(tmp_path / "zeropp", *ZEROPP, gradient_bits)
    # The comparison means something only if training went somewhere: the small GPT starts
    # near ln(vocab) and must have learnt well below it.
    assert final_loss(unquantized) < 0.5 * unquantized[0]["loss"], final_loss(unquantized)
    # ZeRO++ ran: qgZ and qwZ cut the bytes between the nodes (issue 16's 0.3x goal).
    exact_bytes, zeropp_bytes = (r[-1]["inter_node_bytes"] for r in (unquantized, quantized))
    assert 0 < zeropp_bytes < 0.3 * exact_bytes, (zeropp_bytes, exact_bytes)
    exact, lossy = final_loss(unquantized), final_loss(quantized)
    assert abs(lossy - exact) <= TOLERANCE * exact, (
        f"{gradient_bits}: final loss {lossy:.4f} vs {exact:.4f} unquantized, "
        f"{(lossy - exact) / exact:+.2%} (bound {TOLERANCE:.0%})"
    )
