"""The benchmark reports of issue 17, rendered from small fabricated JSON (no launch):

- peers.md (tools/peers/report.py): both largest-model tables (without and with
  activation checkpointing), the largest-model goal rows of each, met or missed by the
  figures given, and the peak-per-phase table;
- a launch run in parts (tools.peers.search.LAUNCH_PARTS): one report, each row's ratios
  to the DDP of its own part, and the column marked so in peers.md;
- the search's step rule (tools.peers.search.search_layers) with the finer growth used
  with checkpointing: it still brackets and finds the answer;
- scaling.md (tools/peers/scaling.py): the (N, batch) launches of both series, and each
  row's prediction 16Ψ/N + activations from zero_core's estimates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.peers import report as peers_report
from tools.peers import scaling as peers_scaling
from tools.peers import search as peers_search
from zero_core.estimate.activations import TransformerShape, activation_bytes

MIB = 2**20
MODEL = {"vocab_size": 256, "context": 32, "layers": 2, "heads": 2, "width": 32,
         "tie_weights": True, "parameters": 33_000}  # fmt: skip


def result_row(
    variant: str, step_s: float, rss: float, phases: tuple[float, ...]
) -> dict[str, Any]:
    states = {"parameters": MIB, "gradients": MIB, "optimizer_states": 2 * MIB, "other": 0}
    return {
        "variant": variant,
        "median_step_s": step_s,
        "round_step_s": [step_s],
        "ratio_to_ddp": step_s / 0.5,
        "state_bytes": {**states, "model_states": 4 * MIB},
        "rss_increase_mib": rss,
        "rss_peak_mib": rss + 100,
        "comm_bytes_per_step": MIB,
        "comm_calls_per_step": {"all_reduce": 1},
        "loss": 5.0,
        "losses_rank0": [5.0],
        "build_s": 0.1,
        "phase_peaks": {
            name: {"increase_mib": v, "start_increase_mib": 1.0}
            for name, v in zip(("forward", "backward", "step"), phases, strict=True)
        },
    }


def launch_report(
    n: int = 4, batch: int = 1, rows: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "world_size": n, "size": "smoke", "model": MODEL, "batch_per_rank": batch,
        "checkpoint": "none", "warmup": 1, "steps": 2, "rounds": 1, "threads": 1,
        "bucket_numel": 2**22, "date": "2026-12-02T00:00:00+00:00", "command": "bench",
        "machine": {"cpu": "cpu", "cpu_count": 2, "memory_gib": 8.0, "system": "Linux",
                    "python": "3.11"},
        "versions": {"torch": "2.13.0"}, "git_head": "abc1234", "uncommitted": [],
        "sources": "0" * 12, "sources_changed_during_run": False, "deepspeed_error": None,
        "results": rows if rows is not None else [
            result_row("ours-0", 0.55, 900.0, (444.0, 555.0, 466.0)),
            result_row("ours-3", 1.0, 300.0, (111.0, 222.0, 133.0)),
            result_row("ddp", 0.5, 900.0, (444.0, 555.0, 466.0)),
            result_row("fsdp2", 1.2, 320.0, (120.0, 240.0, 140.0)),
        ],
    }  # fmt: skip


def found(variant: str, layers: int, params: int) -> dict[str, Any]:
    probe = {"layers": layers, "ok": True, "how": "ran", "seconds": 10.0,
             "ranks": [{"rss_increase_mib": 1000.0}]}  # fmt: skip
    return {"variant": variant, "layers": layers, "parameters": params,
            "first_failing_layers": layers + 1, "probes": [probe], "converged": True}  # fmt: skip


def search(mode: str, params: dict[str, int]) -> dict[str, Any]:
    return {
        "world_size": 4, "width": 1024, "heads": 16, "context": 128, "batch_per_rank": 1,
        "checkpoint": mode, "budget_mib_per_rank": 1536, "limit": "RLIMIT_AS",
        "results": [found(v, 10, p * 10**6) for v, p in params.items()],
    }  # fmt: skip


def test_peers_report_has_both_largest_tables_goal_rows_and_phase_peaks(tmp_path: Path) -> None:
    raw = tmp_path / "peers-json"
    raw.mkdir()
    (raw / "peers-smoke-n4.json").write_text(json.dumps(launch_report()))
    without = {"ddp": 100, "ours-1": 150, "ours-2": 150, "ours-3": 360, "fsdp2": 300,
               "deepspeed-1": 150, "deepspeed-2": 160, "deepspeed-3": 300}  # fmt: skip
    # ours-3 = 1.2x FSDP2 and 3.6x DDP, ours-1 = DeepSpeed-1, ours-2 < DeepSpeed-2
    (raw / "largest-n4.json").write_text(json.dumps(search("none", without)))
    with_ = {**without, "ours-3": 340, "fsdp2": 300}  # 1.13x FSDP2: missed; 3.4x DDP: missed
    (raw / "largest-n4-checkpoint.json").write_text(json.dumps(search("full", with_)))
    peers_report.write_docs(tmp_path, raw)
    text = (tmp_path / "peers.md").read_text()
    assert "## Largest trainable GPT, N = 4, without activation checkpointing" in text
    assert "## Largest trainable GPT, N = 4, with activation checkpointing" in text
    rows = [line for line in text.splitlines() if line.startswith("| largest model")]
    assert len(rows) == 2 * len(peers_report.LARGEST_GOALS)
    verdict = {(r.split("|")[1].strip(), "no checkpointing" in r): r.split("|")[-2].strip()
               for r in rows}  # fmt: skip
    assert verdict[("largest model, ours-3 >= 1.15x fsdp2", True)] == "yes"
    assert verdict[("largest model, ours-3 >= 1.15x fsdp2", False)] == "NO"
    assert verdict[("largest model, ours-1 >= 1x deepspeed-1", True)] == "yes"
    assert verdict[("largest model, ours-2 >= 1x deepspeed-2", True)] == "NO"
    assert verdict[("largest model, ours-3 >= 3.5x ddp", True)] == "yes"
    assert verdict[("largest model, ours-3 >= 3.5x ddp", False)] == "NO"
    assert "| 1.20x (360M vs 300M) | yes |" in text
    assert "| ours-0 step time <= 1.05x DDP | 0M N=4 | 1.10x | NO |" in text  # issue 17
    assert "| ours-3 step time <= 1.15x DDP | 0M N=4 | 2.00x | NO |" in text
    assert "### Peak resident memory per phase of one step" in text
    assert "| ours-3 | 111 / 222 / 133 |" in text
    assert "| fsdp2 | 120 / 240 / 140 |" in text
    charts = text.split("## Charts")[-1]
    if "![" in charts:  # matplotlib is installed: the two charts, nothing else
        assert charts.count("![") == 2 and (tmp_path / "peers-largest.png").exists()


def test_a_search_without_a_peer_says_so_and_old_launches_render_without_phases(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "peers-json"
    raw.mkdir()
    old = launch_report()
    for row in old["results"]:
        del row["phase_peaks"]  # a launch written before the per-phase tracker
    (raw / "peers-smoke-n4.json").write_text(json.dumps(old))
    (raw / "largest-n4.json").write_text(json.dumps(search("none", {"ours-3": 1, "ddp": 1})))
    peers_report.write_docs(tmp_path, raw)
    text = (tmp_path / "peers.md").read_text()
    assert "per phase" not in text
    assert (
        "| largest model, ours-3 >= 1.15x fsdp2 | N=4, no checkpointing | not searched | - |"
        in text
    )
    assert "with activation checkpointing" not in text


def test_a_launch_in_parts_merges_into_one_column_with_ratios_to_its_own_ddp(
    tmp_path: Path,
) -> None:
    first = launch_report(rows=[result_row("ours-3", 1.0, 300.0, (1.0, 2.0, 3.0)),
                                result_row("ddp", 0.5, 900.0, (1.0, 2.0, 3.0))])  # fmt: skip
    second = launch_report(rows=[result_row("ddp", 2.0, 900.0, (1.0, 2.0, 3.0)),
                                 result_row("fsdp2", 3.0, 320.0, (1.0, 2.0, 3.0))])  # fmt: skip
    second["command"] = "bench part 2"
    for row in second["results"]:
        row["ratio_to_ddp"] = row["median_step_s"] / 2.0  # per round, to its own part's DDP
    merged = peers_search.merge_parts([first, second])
    assert [r["variant"] for r in merged["results"]] == ["ours-3", "ddp", "fsdp2"]
    assert [r["ddp_median_step_s"] for r in merged["results"]] == [0.5, 0.5, 2.0]
    assert merged["part_commands"] == ["bench", "bench part 2"]
    raw = tmp_path / "peers-json"
    raw.mkdir()
    (raw / "peers-smoke-n4.json").write_text(json.dumps(merged))
    peers_report.write_docs(tmp_path, raw)
    text = (tmp_path / "peers.md").read_text()
    assert "ran in 2 processes" in text
    # fsdp2: 3.0 s against its own part's DDP (2.0 s) is 1.50, not 6.00 against the first's
    assert "| fsdp2 | 3.000; 1.50 (1.50) |" in text
    assert "| ours-3 step time <= 1.15x DDP | 0M N=4 | 2.00x | NO |" in text
    assert "| ours-3 | 1.000; 2.00 (2.00) |" in text


def test_the_step_table_shows_the_spread_of_the_rounds(tmp_path: Path) -> None:
    """Rows that kept their per-round ratios show [lowest-highest]; older rows get them
    from the round times where their DDP is the launch's, and one round shows none."""
    ours = result_row("ours-0", 1.0, 300.0, (1.0, 2.0, 3.0))
    ours |= {"round_step_s": [1.0, 1.3, 0.9], "round_ratios_to_ddp": [0.98, 1.21, 0.86]}
    older = result_row("ours-1", 1.0, 300.0, (1.0, 2.0, 3.0)) | {"round_step_s": [1.0, 1.1, 0.8]}
    ddp = result_row("ddp", 1.0, 900.0, (1.0, 2.0, 3.0)) | {"round_step_s": [1.0, 1.0, 1.0]}
    ddp["ratio_to_ddp"] = 1.0
    single = result_row("ours-2", 0.5, 300.0, (1.0, 2.0, 3.0))
    report = launch_report(rows=[ours, older, ddp, single])
    assert peers_report.ddp_ratios(ours, report) == "2.00 (1.00) [0.86-1.21]"
    assert peers_report.ddp_ratios(older, report) == "2.00 (1.00) [0.80-1.10]"
    assert peers_report.ddp_ratios(single, report) == "1.00 (0.50)"
    every = {v for part in peers_search.launch_variants("100m", 4) for v in part}
    assert every == set(peers_search.LAUNCH_VARIANTS)
    assert all("ddp" in part for part in peers_search.launch_variants("100m", 4))


def test_each_launch_runs_its_own_rounds_unless_rounds_is_given(tmp_path: Path) -> None:
    """--all gives each launch the rounds of its LAUNCHES row (more where steps are short);
    --rounds sets every launch's; a single launch without it runs 3."""
    from tools.peers import bench as peers_bench

    def rounds_of(argv: list[str]) -> list[int]:
        args = peers_bench.parser().parse_args(argv)
        commands = [
            peers_search.launch_command(s, n, b, r, tmp_path / "x.json", args, ("ddp",))
            for s, n, b, r in peers_search.LAUNCHES
        ]
        return [int(c[c.index("--rounds") + 1]) for c in commands]

    assert rounds_of(["--all"]) == [r for *_, r in peers_search.LAUNCHES]
    assert rounds_of(["--all", "--rounds", "2"]) == [2] * len(peers_search.LAUNCHES)
    assert peers_bench.parser().parse_args([]).rounds is None  # main() makes it 3
    raw = tmp_path / "peers-json"
    raw.mkdir()
    (raw / "peers-smoke-n2.json").write_text(json.dumps(launch_report(n=2) | {"rounds": 7}))
    (raw / "peers-smoke-n4.json").write_text(json.dumps(launch_report(n=4) | {"rounds": 3}))
    peers_report.write_docs(tmp_path, raw)
    text = (tmp_path / "peers.md").read_text()
    assert "every other round): 7 at 0M N=2, 3 at 0M N=4" in text
    assert "7 rounds of 1 + 2 steps" in text and "3 rounds of 1 + 2 steps" in text


def test_step_goals_are_judged_from_the_goal_row_launch_where_there_is_one(
    tmp_path: Path,
) -> None:
    """A (size, N) with a goal-row launch takes its step-time goal rows from it (here ours-0
    1.00, met, where the full launch says 1.10, missed); one without keeps the full
    launch's; the goal-row launch's table is in the report, and the full step table
    still shows the full launch's figure."""
    raw = tmp_path / "peers-json"
    raw.mkdir()
    (raw / "peers-smoke-n2.json").write_text(json.dumps(launch_report(n=2)))
    (raw / "peers-smoke-n4.json").write_text(json.dumps(launch_report(n=4)))
    ddp = result_row("ddp", 0.5, 900.0, (1.0, 2.0, 3.0)) | {"ratio_to_ddp": 1.0}
    ours = result_row("ours-0", 0.5, 300.0, (1.0, 2.0, 3.0)) | {"ratio_to_ddp": 1.0}
    goal = launch_report(n=2, rows=[ddp, ours]) | {"rounds": 15}
    (raw / f"{peers_report.GOAL_PREFIX}smoke-n2.json").write_text(json.dumps(goal))
    peers_report.write_docs(tmp_path, raw)
    text = (tmp_path / "peers.md").read_text()
    assert (
        "| ours-0 step time <= 1.05x DDP | 0M N=2, goal-row launch (15 rounds) | 1.00x | yes |"
        in text
    )
    assert "| ours-0 step time <= 1.05x DDP | 0M N=4 | 1.10x | NO |" in text
    assert "| ours-0 step time <= 1.05x DDP | 0M N=2 | 1.10x | NO |" not in text
    assert "| ours-0 | 1.00 (1.00); full launch (1 rounds) 1.10 |" in text
    # a variant the goal-row launch lacks (it failed there) keeps the full launch's row
    assert "| ours-3 step time <= 1.15x DDP | 0M N=2 | 2.00x | NO |" in text
    assert "## Per goal-row launch" in text and "15 rounds of 1 + 2 steps" in text
    launches = {tuple(x[:2]) for x in peers_search.GOAL_LAUNCHES}
    assert launches <= {tuple(x[:2]) for x in peers_search.LAUNCHES}
    assert set(peers_search.GOAL_VARIANTS) == {"ddp", *peers_report.TARGETS}


def test_goal_rows_only_runs_just_the_goal_launches_and_keeps_the_full_runs_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--all --goal-rows-only`` runs each GOAL_LAUNCHES row with GOAL_VARIANTS and
    nothing else (no full launch, search or scaling); run.json keeps the full run's
    command and gains the goal-row command, which peers.md names, with a failed launch."""
    from tools.peers import bench as peers_bench

    raw = tmp_path / "peers-json"
    raw.mkdir()
    (raw / "peers-smoke-n2.json").write_text(json.dumps(launch_report(n=2)))
    (raw / "run.json").write_text(
        json.dumps({"command": "python -m tools.peers.bench --all", "wall_s": 60})
    )
    ran: list[tuple[Any, ...]] = []
    failing = {"100m"}

    def fake_launch(size: str, n: int, batch: int, rounds: int, path: Path, args: Any,
                    variants: Any = None) -> int:  # fmt: skip
        ran.append((size, n, batch, rounds, path.name, variants))
        return 3 if size in failing else 0

    def refuse(*_: Any) -> None:
        raise AssertionError("--goal-rows-only ran the search or the scaling")

    monkeypatch.setattr(peers_search, "run_peer_launch", fake_launch)
    monkeypatch.setattr(peers_search, "run_search", refuse)
    monkeypatch.setattr(peers_search, "run_scaling", refuse)
    argv = ["tools/peers/bench.py", "--all", "--goal-rows-only", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "orig_argv", argv)
    peers_search.run_all(peers_bench.parser().parse_args(argv[1:]))
    goal = peers_report.GOAL_PREFIX
    assert ran == [
        (s, n, b, r, f"{goal}{s}-n{n}.json", peers_search.GOAL_VARIANTS)
        for s, n, b, r in peers_search.GOAL_LAUNCHES
    ]
    run = json.loads((raw / "run.json").read_text())
    assert run["command"] == "python -m tools.peers.bench --all" and run["wall_s"] == 60
    assert run["goal_rows_command"] == " ".join(argv)
    text = (tmp_path / "peers.md").read_text()
    assert "- goal-row launches, run again on their own: `" in text
    assert "--goal-rows-only" in text and "; failed: 100m N=2, goal rows (exit 3)" in text
    failing.clear()  # run again, every launch succeeding: the earlier failure is not this one's
    peers_search.run_all(peers_bench.parser().parse_args(argv[1:]))
    assert "; failed:" not in (tmp_path / "peers.md").read_text()


@given(
    st.lists(st.floats(0.5, 2.0, allow_nan=False), min_size=1, max_size=40, unique=True),
    st.sampled_from([0.9, 0.95, 0.99]),
)
def test_the_median_interval_is_the_narrowest_order_statistics_with_the_coverage(
    values: list[float], confidence: float
) -> None:
    """[x(k), x(n-k+1)] covers the median with 1 - 2 P(Binomial(n, 1/2) < k): the
    interval returned has at least ``confidence``, the next narrower one has less, and
    none is given where even the whole range has less."""
    n, ordered = len(values), sorted(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    found = peers_report.median_interval(values, confidence)
    if coverage(1) < confidence:
        assert found is None
        return
    assert found is not None
    k = next(k for k in range(1, n + 1) if found == (ordered[k - 1], ordered[n - k]))
    assert coverage(k) >= confidence
    assert k + 1 > n // 2 or coverage(k + 1) < confidence
    assert peers_report.median_interval(list(range(15))) == (3, 11)  # 96.5%


@pytest.mark.parametrize("answer", [3, 11, 14, 40])
def test_search_with_the_finer_growth_brackets_and_finds_the_answer(answer: int) -> None:
    def fake_probe(layers: int) -> dict[str, Any]:
        return {"ok": layers <= answer, "how": "ran", "parameters": layers, "seconds": 0.0}

    lo, hi, probes = peers_search.search_layers(
        fake_probe, 12, max_probes=12, deadline=time.time() + 60, label="test", growth=1.125
    )
    assert lo == answer or (hi - lo <= max(1, lo // 8) and lo <= answer < hi)
    assert all(p["ok"] == (p["parameters"] <= answer) for p in probes)


@pytest.mark.parametrize("answer", [1, 12, 22, 24, 26, 32])
def test_the_peer_search_bisects_to_one_layer(answer: int) -> None:
    """With tolerance 0 (the peer search) the bracket ends one layer wide, so 24 against
    27 layers (1.125x) is resolved instead of read as a tie."""

    def fake_probe(layers: int) -> dict[str, Any]:
        return {"ok": layers <= answer, "how": "ran", "parameters": layers, "seconds": 0.0}

    lo, hi, _ = peers_search.search_layers(
        fake_probe,
        22,  # ours-3's and FSDP2's first guess at 1536 MiB
        max_probes=peers_search.MAX_PROBES,
        deadline=time.time() + 60,
        label="test",
        tolerance=0.0,
    )
    assert (lo, hi) == (answer, answer + 1)


def test_the_search_time_is_shared_by_each_variants_first_guess() -> None:
    """Stage 3 starts at 22 layers and DDP at 5: stage 3 gets 22/27 of the time left, not
    half, so its last probes (a minute each at 25 layers) are reached."""
    ours3 = peers_search.first_guess("ours-3", 1536)
    ddp = peers_search.first_guess("ddp", 1536)
    assert (ours3, ddp) == (22, 5)
    share = peers_search.time_share(60.0, [ours3, ddp])
    assert share == pytest.approx(60.0 * ours3 / (ours3 + ddp))
    assert peers_search.time_share(60.0, [ddp]) == 60.0


def scaling_args(**overrides: Any) -> argparse.Namespace:
    args = peers_scaling.parser().parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_scaling_launches_each_pair_once_and_rejects_an_uneven_global_batch() -> None:
    assert peers_scaling.launch_pairs([1, 2, 4], 4, 1) == [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1)]
    with pytest.raises(SystemExit, match="not a multiple"):
        peers_scaling.launch_pairs([1, 2, 4], 6, 1)


def test_scaling_report_rows_and_prediction(tmp_path: Path) -> None:
    args = scaling_args(rounds=2)
    raw = tmp_path / "scaling-json"
    raw.mkdir()
    for r in range(2):
        for n, batch in peers_scaling.launch_pairs(args.ns, args.global_batch, args.per_rank_batch):
            rows = [
                result_row("ours-3", 1.0 + r + batch / n, 100.0 / n + r, (1.0, 2.0, 3.0)),
                result_row("fsdp2", 2.0 + r + batch / n, 120.0 / n, (1.0, 2.0, 3.0)),
            ]
            report = launch_report(n, batch, rows)
            (raw / peers_scaling.json_name(r, n, batch)).write_text(json.dumps(report))
    summary = peers_scaling.summarize(args, raw)
    rows = summary["rows"]
    assert len(rows) == 2 * 3 * 2  # series x N x variant
    strong4 = next(r for r in rows if r["series"] == "strong" and r["world_size"] == 4
                   and r["variant"] == "ours-3")  # fmt: skip
    assert strong4["batch_per_rank"] == 1
    assert strong4["step_s"] == {"median": 1.75, "min": 1.25, "max": 2.25}
    assert strong4["rss_increase_mib"] == {"median": 25.5, "min": 25.0, "max": 26.0}
    assert strong4["ours3_over_fsdp2"] == pytest.approx((1.25 / 2.25 + 2.25 / 3.25) / 2)
    psi = MODEL["parameters"]
    assert strong4["paper_model_states_mib"] == pytest.approx(16 * psi / 4 / MIB)
    shape = TransformerShape(2, 32, 2, 256, 1 * 32)
    assert strong4["activation_peak_mib"] == pytest.approx(activation_bytes(shape).peak / MIB)
    weak1 = next(r for r in rows if r["series"] == "weak" and r["world_size"] == 1
                 and r["variant"] == "fsdp2")  # fmt: skip
    assert weak1["batch_per_rank"] == 1 and weak1["paper_model_states_mib"] == pytest.approx(
        16 * psi / MIB
    )
    text = peers_scaling.markdown(summary, "peers_scaling.py", 60.0)
    assert "## Strong scaling" in text and "## Weak scaling" in text
    # strong N=4 ours-3: t(1) (batch 4: 5.0 / 6.0 -> 5.5) over t(4) 1.75
    assert f"| {5.5 / 1.75:.2f} |" in text


def test_a_run_that_skipped_the_search_says_where_the_largest_model_tables_come_from() -> None:
    searches = [search("none", {"ours-3": 1}), search("full", {"ours-3": 1})]
    skipped = {"command": "python -m tools.peers.bench --all --skip-search"}
    line = peers_report.search_provenance(skipped, searches)
    assert "**not part of this run**" in line and "does not record when" in line
    searches[0] |= {"date": "2026-12-04T20:00:00+00:00", "git_head": "abc1234"}
    line = peers_report.search_provenance(skipped, searches[:1])
    assert "2026-12-04T20:00:00+00:00, git commit abc1234" in line
    assert "part of the command above" in peers_report.search_provenance(
        {"command": "python -m tools.peers.bench --all"}, searches
    )
    later = {**skipped, "search_command": "python -m tools.peers.bench --all --search-only"}
    line = peers_report.search_provenance(later, searches[:1])
    assert "run again on its own (2026-12-04T20:00:00+00:00, git commit abc1234)" in line


def test_a_search_of_some_variants_keeps_the_others_each_with_its_own_date(
    tmp_path: Path,
) -> None:
    """``--search-variants``: the new answers replace theirs, the others stay, stamped with
    the date and commit of the search that found them; a file of another budget is not
    merged (its answers would not compare)."""
    path = tmp_path / "largest-n4.json"
    old = {
        "budget_mib_per_rank": 1536,
        "date": "2026-12-04T20:00:00+00:00",
        "git_head": "abc1234",
        "results": [{"variant": "ours-3", "layers": 26}, {"variant": "fsdp2", "layers": 25}],
    }
    path.write_text(json.dumps(old))
    new = [
        {"variant": "fsdp2", "layers": 24, "date": "2026-12-05", "git_head": "def5678"},
        {"variant": "ours-3-in-bwd", "layers": 33, "date": "2026-12-05", "git_head": "def5678"},
    ]
    merged = peers_search.kept_results(path, new, 1536)
    assert [(r["variant"], r["layers"], r["git_head"]) for r in merged] == [
        ("ours-3", 26, "abc1234"),
        ("fsdp2", 24, "def5678"),
        ("ours-3-in-bwd", 33, "def5678"),
    ]
    assert peers_search.kept_results(path, new, 2048) == new
    line = peers_report.search_provenance(
        {"search_command": "x"}, [{**old, "date": "2026-12-05", "results": merged}]
    )
    assert "2026-12-04T20:00:00+00:00, git commit abc1234" in line and "def5678" in line


def test_the_step_in_backward_variants_hold_no_gradient_in_the_paper_formula() -> None:
    """12 bytes per parameter / N instead of 16 (float32 Adam at stage 3), so the search
    starts them higher and does not refuse their probes by the 16-byte estimate."""
    psi, n = 10**8, 4
    plain = peers_report.paper_model_states_mib("ours-3", psi, n)
    fused = peers_report.paper_model_states_mib("ours-3-in-bwd", psi, n)
    assert plain is not None and fused is not None
    assert fused == pytest.approx(plain * 12 / 16)
    assert peers_report.paper_model_states_mib("fsdp2-in-bwd", psi, n) == fused
