"""The same DeepSpeed-shaped scripts under real DeepSpeed and under zero_core.deepspeed agree
within float tolerance (issue 46, "Done when", point 3). Runs in ``nox -s deepspeed`` only
(marker ``deepspeed``); skips, saying why, where DeepSpeed does not import.

Each script of tests/deepspeed_scripts/ runs on 2 ranks at stages 0-3 in every dtype that
DeepSpeed's CPU accelerator takes here (fp16 only where ``is_fp16_supported()``): as
written, under DeepSpeed's own launcher (gloo), and ported (imports only) under zero-launch.
Rank 0's per-step losses and learning rates are compared. Every result, and every launch
that failed, goes to docs/benchmarks/deepspeed-agreement.md and .json, written before the
assertions so a failing run still leaves its evidence.

Tolerances (relative, per step; the runs are 4 steps of tiny models):

- fp32 1e-5. Both run the same torch kernels and the same torch AdamW on the same data;
  only the order of a few sums can differ (DeepSpeed's gradient norm for clipping, its
  bucketing). Seen here: bit-equal at every stage, for both scripts (2026-12-07).
- bf16 2e-2, about two bf16 ulps (2^-7 = 0.0078 each). The parameters are bf16 copies of
  float32 masters in both; a master that lands on the other side of a bf16 rounding
  boundary moves a weight by an ulp, and the next forward's bf16 activations amplify that.
  DeepSpeed also reduces bf16 gradients in its own order and dtype. DeepSpeed's own stages
  differ from each other by this much (the report's last column), so a tighter bound would
  test DeepSpeed, not us. Seen here (2026-12-07): BERT at most 1.1e-4 (DeepSpeed's own
  stages 5.3e-4 apart); CIFAR, its schedule made constant to set aside the one below, at
  most 6.7e-3 (stage 0; at stages 1-3 ours equals DeepSpeed bit for bit).
- fp16 5e-3 (never reached here: DeepSpeed's CPU accelerator refuses fp16 on this CPU).
- Learning rates 1e-12: the same schedule formula must give the same number. (This found
  zero_core's WarmupSchedule one update ahead of DeepSpeed's WarmupLR, which applies
  warmup_min_lr to updates 0 and 1; fixed in zero_core.)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from deepspeed_scripts import runs

pytestmark = [pytest.mark.deepspeed, pytest.mark.timeout(3600)]

REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "deepspeed-agreement"
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
LR_TOLERANCE = 1e-12


class Comparison(NamedTuple):
    script: str
    dtype: str
    stage: int
    deepspeed: list[float] | str  # rank 0's losses, or why the launch failed
    ours: list[float] | str
    deepspeed_lrs: list[float]
    ours_lrs: list[float]
    seconds: dict[str, float]
    notes: list[str]  # a DeepSpeed launch that crashed and was run again
    failure_output: dict[str, str]  # the end of a failed launch's output, by framework


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def largest_difference(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """(largest absolute, largest relative) difference over the steps."""
    pairs = list(zip(ours, theirs, strict=True))
    return max(abs(a - b) for a, b in pairs), max(relative(a, b) for a, b in pairs)


def problems(row: Comparison) -> list[str]:
    """What makes ``row`` fail: a failed launch, a different step count, a loss or a
    learning rate outside its tolerance."""
    where = f"{row.script} stage {row.stage} {row.dtype}"
    found = [f"{where}: {name} failed: {result}" for name, result in
             (("DeepSpeed", row.deepspeed), ("zero_core.deepspeed", row.ours))
             if isinstance(result, str)]  # fmt: skip
    if found:
        return found
    assert not isinstance(row.ours, str) and not isinstance(row.deepspeed, str)
    if len(row.ours) != len(row.deepspeed):
        return [f"{where}: DeepSpeed ran {len(row.deepspeed)} steps, ours {len(row.ours)}"]
    _, worst = largest_difference(row.ours, row.deepspeed)
    if worst > LOSS_TOLERANCE[row.dtype]:
        found.append(f"{where}: losses differ by {worst:.3g} relative (tolerance "
                     f"{LOSS_TOLERANCE[row.dtype]}): ours {row.ours}, "
                     f"DeepSpeed {row.deepspeed}")  # fmt: skip
    if row.ours_lrs != row.deepspeed_lrs and (
        len(row.ours_lrs) != len(row.deepspeed_lrs)
        or max(map(relative, row.ours_lrs, row.deepspeed_lrs)) > LR_TOLERANCE
    ):
        found.append(f"{where}: learning rates after each step differ: ours {row.ours_lrs}, "
                     f"DeepSpeed {row.deepspeed_lrs}")  # fmt: skip
    return found


# DeepSpeed 0.19.8 on CPU once ended a launch that had run every step with "terminate called
# without an active exception" (1 launch of 16; the same launch then passed 3 times out of
# 3): a DeepSpeed launch that fails is run once more, and the report says so.
DEEPSPEED_ATTEMPTS = 2


def run_both(script: Path, stage: int, dtype: str, folder: Path) -> Comparison:
    results: dict[str, Any] = {}
    seconds, notes, failure_output = {}, [], {}
    for name, launch in (("deepspeed", runs.deepspeed), ("ours", runs.ours)):
        start = time.perf_counter()
        attempts = DEEPSPEED_ATTEMPTS if name == "deepspeed" else 1
        for attempt in range(1, attempts + 1):
            try:
                results[name] = launch(script, stage, dtype, folder / f"{name}-{attempt}")
                break
            except AssertionError as exc:  # the launch's own output, in a line
                failure_output[name] = str(exc)[-4000:]
                lines = [x for x in str(exc).splitlines() if x.strip()]
                errors = [x for x in lines if "Error" in x or "error" in x]
                results[name] = (errors or lines)[-1][-400:]
                if attempt < attempts:
                    notes.append(
                        f"DeepSpeed's launch {attempt} failed ({results[name]}); ran again"
                    )
        seconds[name] = round(time.perf_counter() - start, 1)

    def losses(name: str) -> list[float] | str:
        got = results[name]
        return got if isinstance(got, str) else list(got.losses)

    def lrs(name: str) -> list[float]:
        got = results[name]
        return [] if isinstance(got, str) else list(got.lrs)

    return Comparison(script.stem, dtype, stage, losses("deepspeed"), losses("ours"),
                      lrs("deepspeed"), lrs("ours"), seconds, notes, failure_output)  # fmt: skip


def deepspeed_dtypes() -> tuple[list[str], dict[str, str]]:
    """The dtypes DeepSpeed's accelerator takes here, and why each other one is left out."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # any failure to import a peer is a reason to skip, said
        pytest.skip(f"DeepSpeed does not import here: {type(exc).__name__}: {exc}")
    accelerator = get_accelerator()
    left_out = {}
    if not accelerator.is_bf16_supported():
        left_out["bf16"] = f"{type(accelerator).__name__}.is_bf16_supported() is false here"
    if not accelerator.is_fp16_supported():
        left_out["fp16"] = (
            f"{type(accelerator).__name__}.is_fp16_supported() is false here: DeepSpeed stops "
            "with 'Type fp16 is not supported on your device.'"
        )
    return [d for d in runs.DTYPES if d not in left_out], left_out


def test_the_scripts_agree_with_real_deepspeed(tmp_path: Path) -> None:
    dtypes, left_out = deepspeed_dtypes()
    import deepspeed

    start = time.perf_counter()
    rows = [
        run_both(script, stage, dtype, tmp_path / f"{script.stem}-{dtype}-{stage}")
        for script in runs.SCRIPTS
        for dtype in dtypes
        for stage in runs.STAGES
    ]
    wall = time.perf_counter() - start
    write_report(rows, left_out, wall, deepspeed.__version__)
    failures = [problem for row in rows for problem in problems(row)]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------- the report
def write_report(rows: list[Comparison], left_out: dict[str, str], wall: float,
                 version: str) -> None:  # fmt: skip
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    header = {
        "revision": revision(),
        "versions": f"torch {torch.__version__}, deepspeed {version}",
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"),
        "wall_seconds": round(wall),
        "left_out": left_out,
        "tolerance": {"loss_relative": LOSS_TOLERANCE, "lr_relative": LR_TOLERANCE},
    }
    REPORT.with_suffix(".json").write_text(
        json.dumps({**header, "rows": [r._asdict() for r in rows]}, indent=1) + "\n"
    )
    REPORT.with_suffix(".md").write_text(markdown(rows, header))


def revision() -> str:
    """``git describe --always --dirty`` of this repository (and the commit being merged
    into it, if a merge is under way), or why there is none."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=REPORT.parent, timeout=30)  # fmt: skip
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        described = git("describe", "--always", "--dirty")
        merging = git("rev-parse", "--short", "-q", "--verify", "MERGE_HEAD")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(no git revision: {exc})"
    return described + (f" while merging {merging}" if merging else "")


def markdown(rows: list[Comparison], header: dict[str, Any]) -> str:
    spread = deepspeed_spread(rows)
    lines = [
        "# The DeepSpeed-shaped scripts under real DeepSpeed and under zero_core.deepspeed",
        "",
        "Written by `nox -s deepspeed` (tests/test_deepspeed_real.py): each script of",
        "tests/deepspeed_scripts/ on 2 CPU ranks (gloo), 4 steps, as written under DeepSpeed's",
        "launcher and with only its imports changed under zero-launch. The columns are the",
        "largest difference over the steps of rank 0's loss, and of the learning rate after",
        "each step; the last column is how far DeepSpeed's own stage differs from its stage 0,",
        "for scale.",
        "",
        f"- {header['versions']}; {header['machine']}; {header['date']}; "
        f"this repository at {header['revision']}",
        f"- the launches took {header['wall_seconds']} s in all",
        f"- tolerance (relative, per step): losses {header['tolerance']['loss_relative']}, "
        f"learning rates {header['tolerance']['lr_relative']}",
    ]
    lines += [f"- {dtype} left out: {why}" for dtype, why in header["left_out"].items()]
    lines += [
        "",
        "| script | dtype | stage | loss abs | loss rel | lr abs | DeepSpeed vs its stage 0 "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        verdict = "; ".join(problems(row) + row.notes) or "agrees"
        if isinstance(row.ours, str) or isinstance(row.deepspeed, str):
            lines.append(f"| {row.script} | {row.dtype} | {row.stage} | - | - | - | - | "
                         f"{verdict.replace('|', '/')} |")  # fmt: skip
            continue
        absolute, rel = largest_difference(row.ours, row.deepspeed)
        lr = (max(abs(a - b) for a, b in zip(row.ours_lrs, row.deepspeed_lrs, strict=True))
              if row.ours_lrs and len(row.ours_lrs) == len(row.deepspeed_lrs) else 0.0)  # fmt: skip
        if "losses differ" in verdict or "learning rates" in verdict:
            verdict = "; ".join(["outside tolerance" + (" (learning rates differ)" if lr else ""),
                                 *row.notes])  # fmt: skip
        elif row.notes:
            verdict = "agrees; " + "; ".join(row.notes)
        own = spread.get((row.script, row.dtype, row.stage))
        own_text = "-" if own is None else f"{own:.3g}"
        lines.append(f"| {row.script} | {row.dtype} | {row.stage} | {absolute:.3g} | {rel:.3g} | "
                     f"{lr:.3g} | {own_text} | {verdict} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def deepspeed_spread(rows: list[Comparison]) -> dict[tuple[str, str, int], float]:
    """(script, dtype, stage) -> largest relative difference of DeepSpeed's losses at that
    stage from its own stage 0's."""
    zero = {(r.script, r.dtype): r.deepspeed for r in rows if r.stage == 0}
    out = {}
    for row in rows:
        base = zero.get((row.script, row.dtype))
        if isinstance(row.deepspeed, str) or not isinstance(base, list):
            continue
        if len(base) == len(row.deepspeed):
            out[(row.script, row.dtype, row.stage)] = largest_difference(row.deepspeed, base)[1]
    return out
