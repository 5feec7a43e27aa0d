"""tools/hetero: the bench's table and ideal from given rows, the quota tool's refusal
where it cannot work, and (slow) one short padded run of the bench end to end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.hetero.bench import ideal_seconds, table, zero_train
from tools.hetero.cpu_quota import cpu_cgroup_root, quota_problem

ROOT = Path(__file__).resolve().parents[1]


def rows() -> list[dict[str, object]]:
    profiles = [{"seconds_per_micro_batch": 0.2}, {"seconds_per_micro_batch": 0.4}]

    def row(counts: str, median: float, chosen: list[int], predicted: float | None) -> dict:
        return {"counts": counts, "chosen": chosen, "median_s": median, "min_s": median - 0.01,
                "max_s": median + 0.01, "predicted_s": predicted, "profiles": profiles}  # fmt: skip

    return [row("8,4", 1.64, [8, 4], None), row("6,6", 2.43, [6, 6], None),
            row("auto", 1.65, [8, 4], 1.60)]  # fmt: skip


def test_the_table_compares_with_the_ideal_and_the_even_split() -> None:
    args = argparse.Namespace(mode="pad", seconds=0.2)
    assert ideal_seconds(args, rows()[0]) == pytest.approx(1.6)
    lines = table(args, rows())
    assert lines[2] == "| 8,4 | 1.640 | 1.630-1.650 | 1.600 | 1.025x | 1.482x |  |"
    assert lines[3].startswith("| 6,6 | 2.430 |") and "| 1.000x |" in lines[3]
    assert lines[4].startswith("| auto (8,4) |") and lines[4].endswith("| 1.600 (+3.1%) |")
    # With quotas each run's ideal comes from its own ranks' slot times (the median over
    # its steps), not from another run's or the profile's.
    quota = argparse.Namespace(mode="quota", seconds=None)
    timed = rows()
    timed[0]["slot_s"] = [[0.1, 0.1, 0.5], [0.3, 0.2, 0.3]]  # [rank][step]: medians 0.1, 0.3
    timed[1]["slot_s"] = [[0.2, 0.2, 0.2], [0.4, 0.4, 0.4]]
    timed[2]["slot_s"] = [[0.2, 0.2, 0.2], [0.4, 0.4, 0.4]]
    assert ideal_seconds(quota, timed[0]) == pytest.approx(12 / (1 / 0.1 + 1 / 0.3))
    assert ideal_seconds(quota, timed[1]) == pytest.approx(1.6)
    assert table(quota, timed)[2] == "| 8,4 | 1.640 | 1.630-1.650 | 0.900 | 1.822x | 1.482x |  |"


def test_the_command_pads_the_slots_two_to_one() -> None:
    args = argparse.Namespace(steps=8, micro_batch=1, stage=2, mode="pad", seconds=0.2)
    command = zero_train(args, "auto", Path("out"))
    assert command[command.index("--emulate-micro-batch-seconds") + 1] == "0.2,0.4"
    assert command[command.index("--batch-size") + 1] == "12"
    assert command[command.index("--virtual-ranks") + 1] == "12"
    args.mode = "quota"
    assert "--emulate-micro-batch-seconds" not in zero_train(args, "8,4", Path("out"))


def test_quotas_say_why_not_where_they_cannot_be_set() -> None:
    problem = quota_problem()
    if os.geteuid() != 0:
        assert problem == "needs root (cgroups are written as root)"
    elif cpu_cgroup_root() is None:
        assert problem == "no cgroup mount has the cpu controller"
    else:
        assert problem == "" or "cannot make a cgroup" in problem


@pytest.mark.slow
def test_a_short_padded_bench(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.hetero.bench", "--seconds", "0.1", "--steps", "4",
         "--skip", "1", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    by_counts = {r["counts"]: r for r in report["rows"]}
    assert by_counts["auto"]["chosen"] == [8, 4]
    assert by_counts["6,6"]["median_s"] > 1.3 * by_counts["8,4"]["median_s"]
    auto = by_counts["auto"]
    assert "once per step: planner (this-machine" in auto["auto_line"]
    assert abs(auto["median_s"] / auto["predicted_s"] - 1) <= 0.15
