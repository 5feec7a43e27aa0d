"""The README's expected output is the output of HEAD, and stays so.

golden/default_run.txt holds the losses of the default zero-train run (the README's quick
start, 600 steps) and what their bits depend on (tools/diagnose/golden_losses.py writes it from a
run). A fresh run of the same command, cut off after PREFIX steps with ``--stop-after``
(the learning-rate schedule stays that of 600 steps), must give:

- the same losses bit for bit, where its fingerprint and data equal the file's;
- losses within CROSS_MACHINE_TOLERANCE (relative) of the file's otherwise. The tolerance
  is measured: over the first 30 steps, runs that change only the local arithmetic
  (2 threads per rank instead of 1; torch's kernels without AVX2, ATEN_CPU_CAPABILITY=
  default) differ from the golden run by at most MEASURED_CROSS_MACHINE (relative), see
  packages/zero-core/README.md; the tolerance leaves a factor of 10 on top.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_comm.determinism import fingerprint_differences
from zero_models.golden import loss_mismatches, read_golden
from zero_models.run_metrics import read_metrics

GOLDEN = Path(__file__).parent / "golden" / "default_run.txt"
README = Path(__file__).parents[3] / "README.md"
PREFIX = 30
MEASURED_CROSS_MACHINE = 3.1e-5  # ATEN_CPU_CAPABILITY=default, step 23 (README, the contract)
CROSS_MACHINE_TOLERANCE = 10 * MEASURED_CROSS_MACHINE


def test_a_prefix_of_the_default_run_equals_the_golden_losses(tmp_path: Path) -> None:
    """...and prints the README's memory table, memory per step and traffic, which do
    not depend on the fingerprint (they are counted, not computed in floating point)."""
    golden = read_golden(GOLDEN)
    command = [sys.executable, "-m", "zero_models.train", *golden.argv,
               "--stop-after", str(PREFIX), "--sample-tokens", "1", "--out", "run"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    readme = README.read_text()
    counted = counted_lines(result.stdout)
    assert len(counted) == 5, result.stdout  # title, columns, 2 ranks, traffic
    stale = [line for line in counted if line not in readme]
    assert not stale, f"README.md's quick-start output lacks these lines of a run: {stale}"
    shown_mem = set(re.findall(r"step +\d+/\d+  loss .*  mem ([\d.]+) MiB", readme))
    run_mem = set(re.findall(r"step +\d+/\d+  loss .*  mem ([\d.]+) MiB", result.stdout))
    assert shown_mem == run_mem, f"README shows mem {shown_mem} MiB a step, the run {run_mem}"
    (run,), steps = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [record["loss"] for record in steps]
    if run["corpus"] != golden.corpus:
        pytest.skip(
            "the default corpus (this Python's standard library) differs from the golden "
            f"run's ({run['corpus']} here, {golden.corpus} there): the losses are of other data"
        )
    differences = fingerprint_differences(golden.fingerprint, run["fingerprint"])
    tolerance = CROSS_MACHINE_TOLERANCE if differences else 0.0
    mismatches = loss_mismatches(golden.losses[:PREFIX], losses, tolerance=tolerance)
    named = "; ".join(f"{d.what} {d.before!r} there, {d.now!r} here" for d in differences)
    assert not mismatches, (
        f"the default run's first {PREFIX} losses differ from {GOLDEN.name} "
        + (f"by more than {tolerance:.1e} (fingerprints differ: {named})" if differences
           else "although the fingerprint and data are the golden run's (bitwise expected)")
        + ":\n" + "\n".join(mismatches[:10])
    )  # fmt: skip


def test_the_readme_shows_the_golden_runs_losses() -> None:
    """The quick start's expected output (first and last step, and the summary line) is
    the golden run's, rounded as zero-train prints it."""
    golden = read_golden(GOLDEN)
    text = README.read_text()
    steps = len(golden.losses)
    shown = {int(m[1]): m[2] for m in re.finditer(rf"step +(\d+)/{steps}  loss (\d+\.\d+)", text)}
    assert shown, f"README.md shows no 'step N/{steps}  loss X' line of the default run"
    for step, loss in shown.items():
        assert loss == f"{golden.losses[step - 1]:.4f}", (step, loss)
    first, last = golden.losses[0], golden.losses[-1]
    assert f"loss: {first:.3f} at step 1 -> {last:.3f} at step {steps}" in text


def counted_lines(stdout: str) -> list[str]:
    """zero-train's report lines that are counts (the model-state table per rank and the
    last step's communication), from "memory per rank" to "communication in the last step"."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per rank"))
    end = next(i for i, line in enumerate(lines) if line.startswith("communication in the last"))
    return [line.rstrip() for line in lines[start : end + 1] if line.strip()]
