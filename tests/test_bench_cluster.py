"""tools/cluster/bench.py's pure parts (the schedule, the command line) and
tools/cluster/report.py's (the records, the statistics, the goals and the report).
No cluster is built here (the benchmark itself runs in `nox -s cluster`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.cluster import bench as bc
from tools.cluster import report as bcr

RATE_BITS = 100e6


def record(variant: str, round_index: int, step: int, step_s: float, **kw: float) -> bcr.StepRecord:
    values = {"loss": 5.0, "intra_node_bytes": 1000, "inter_node_bytes": 4000, **kw}
    return bcr.StepRecord("small", variant, round_index, step, step_s, **values)  # type: ignore[arg-type]


def schedule(
    variants: dict[str, list[float]], warmup_s: float = 99.0, **kw: float
) -> list[bcr.StepRecord]:
    """Records of one model: 2 warm-up steps of each variant at ``warmup_s``, then one step
    per round at the times given (round i: ``variants[v][i]``), in rotated order."""
    names = list(variants)
    out = [record(v, -1, s, warmup_s, **kw) for v in names for s in range(2)]
    for r in range(len(next(iter(variants.values())))):
        out += [record(v, r, 2 + r, variants[v][r], **kw) for v in bc.variant_order(names, r)]
    return out


# -- the schedule -------------------------------------------------------------------------------


@given(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=8, unique=True),
       st.integers(0, 50))  # fmt: skip
def test_variant_order_rotates_by_the_round(names: list[str], round_index: int) -> None:
    order = bc.variant_order(names, round_index)
    assert sorted(order) == sorted(names)
    shift = round_index % len(names)
    assert order[0] == names[shift]
    # over len(names) rounds every variant runs once in every position
    positions = {n: {bc.variant_order(names, r).index(n) for r in range(len(names))} for n in names}
    assert all(p == set(range(len(names))) for p in positions.values())


def test_variant_order_needs_variants() -> None:
    with pytest.raises(ValueError, match="at least one"):
        bc.variant_order([], 0)


# -- records ------------------------------------------------------------------------------------


def test_parse_records_splits_steps_from_other_records() -> None:
    step = {**record("flat", 0, 2, 1.5)._asdict(), "rank_step_s": [1.5, 1.4]}
    lines = [json.dumps({"launch": {"world_size": 4}}), "", json.dumps(step), "  "]
    others, steps = bcr.parse_records(lines)
    assert others == [{"launch": {"world_size": 4}}]
    assert steps == [record("flat", 0, 2, 1.5)]
    assert steps[0].timed and not record("flat", -1, 0, 1.0).timed


@pytest.mark.parametrize("line", ["{not json", "[1, 2]"])
def test_parse_records_names_a_bad_line(line: str) -> None:
    with pytest.raises(ValueError, match="record line 2"):
        bcr.parse_records([json.dumps({"launch": {}}), line])


# -- statistics ---------------------------------------------------------------------------------


@given(st.lists(st.floats(0.001, 1e3), min_size=1, max_size=40))
def test_spread_is_ordered(samples: list[float]) -> None:
    s = bcr.Spread.of(samples)
    assert s.low == min(samples) and s.high == max(samples)
    assert s.low <= s.q1 <= s.median <= s.q3 <= s.high


def test_spread_needs_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        bcr.Spread.of([])


@given(st.lists(st.floats(0.5, 20.0), min_size=1, max_size=6),
       st.floats(1.0, 3.0))  # fmt: skip
def test_speedup_is_taken_within_each_round(load: list[float], faster: float) -> None:
    """The machine's load changes from round to round (``load``); ZeRO++ is ``faster`` than
    flat in every round, so the same-round ratio is exact whatever the drift, while the
    ratio of overall medians need not be."""
    records = schedule({"flat": [x * faster for x in load], "zero++": load})
    flat, zpp = bcr.summarize(records, "100mbit", RATE_BITS)
    assert flat.speedup is not None and zpp.speedup is not None
    assert flat.speedup.median == pytest.approx(1.0)
    assert zpp.speedup.median == pytest.approx(faster)
    assert zpp.speedup.low == pytest.approx(faster) == pytest.approx(zpp.speedup.high)


def test_summarize_leaves_out_the_warm_up_steps() -> None:
    records = schedule({"flat": [1.0, 2.0, 3.0], "hpz": [1.0, 1.0, 1.0]}, warmup_s=50.0)
    flat, hpz = bcr.summarize(records, "100mbit", RATE_BITS)
    assert (flat.step_s.median, flat.step_s.low, flat.step_s.high) == (2.0, 1.0, 3.0)
    assert (flat.steps_timed, flat.steps_total) == (3, 5)
    assert hpz.step_s.high == 1.0
    assert flat.final_loss == 5.0


def test_summarize_bytes_ratio_floor_and_final_loss() -> None:
    records = schedule({"flat": [2.0]}, inter_node_bytes=10_000_000)
    records += schedule({"zero++": [1.0]}, inter_node_bytes=1_000_000)
    records.append(record("zero++", 0, 3, 1.0, inter_node_bytes=1_000_000, loss=4.25))
    flat, zpp = bcr.summarize(records, "100mbit", RATE_BITS)
    assert zpp.inter_ratio == pytest.approx(0.1)
    assert flat.inter_ratio == 1.0
    # 10 MB over two directions of 100 Mbit/s: 5e6 * 8 / 1e8 = 0.4 s
    assert flat.link_floor_s == pytest.approx(0.4)
    assert zpp.final_loss == 4.25  # the loss of the last step, not of the last record read
    assert zpp.bytes_constant and flat.bytes_constant
    varying = [*schedule({"flat": [1.0, 1.0]}), record("flat", 1, 9, 1.0, inter_node_bytes=1)]
    assert not bcr.summarize(varying, "100mbit", RATE_BITS)[0].bytes_constant


def test_summarize_without_a_baseline_has_no_ratios() -> None:
    (hpz,) = bcr.summarize(schedule({"hpz": [1.0]}), "100mbit", RATE_BITS)
    assert hpz.speedup is None and hpz.inter_ratio is None


def test_summarize_refuses_a_variant_with_only_warm_up() -> None:
    with pytest.raises(ValueError, match="no timed steps"):
        bcr.summarize([record("flat", -1, 0, 1.0)], "100mbit", RATE_BITS)


# -- goals and report ---------------------------------------------------------------------------


@given(st.floats(0.01, 1.0), st.floats(0.5, 4.0))
def test_goals_follow_the_thresholds(ratio: float, speedup: float) -> None:
    records = schedule({"flat": [speedup]}, inter_node_bytes=1_000_000)
    records += schedule({"zero++": [1.0]}, inter_node_bytes=round(ratio * 1_000_000))
    summaries = bcr.summarize(records, "100mbit", RATE_BITS)
    bytes_goal, speed_goal = bcr.check_goals(summaries, "100mbit")
    measured_ratio = round(ratio * 1_000_000) / 1_000_000
    assert bytes_goal.met == (measured_ratio <= bcr.MAX_INTER_RATIO)
    assert speed_goal.met == (speedup >= bcr.MIN_SPEEDUP)
    assert speed_goal.value == pytest.approx(speedup)
    assert ("NOT MET" in speed_goal.line()) != speed_goal.met


def test_goals_without_zeropp_are_not_met() -> None:
    summaries = bcr.summarize(schedule({"flat": [1.0]}), "100mbit", RATE_BITS)
    verdicts = bcr.check_goals(summaries, "100mbit")
    assert [v.met for v in verdicts] == [False, False]
    assert all(v.value is None and "not measured" in v.line() for v in verdicts)
    assert bcr.check_goals(summaries, "300mbit") == []  # no model measured at that rate


def test_report_has_a_row_per_summary_and_every_verdict() -> None:
    records = schedule({"flat": [2.0, 2.2, 2.1], "hybrid": [1.5, 1.6, 1.4], "zero++": [1, 1, 1]})
    summaries = bcr.summarize(records, "100mbit", RATE_BITS)
    verdicts = bcr.check_goals(summaries, "100mbit")
    table = bcr.markdown_table(summaries).splitlines()
    columns = table[0].count("|")
    assert len(table) == 2 + len(summaries)
    assert all(line.count("|") == columns for line in table)
    report = bcr.render_report(summaries, verdicts, {"main_rate": "100mbit", "notes": ["n1"]})
    assert all(v.line() in report for v in verdicts)
    assert "- n1" in report and "| small | 100mbit | hybrid |" in report


def test_exactness_notes_name_the_variants_on_flats_losses() -> None:
    """A variant is on flat's losses only if every step's loss is flat's at that step: one
    step off (here the last warm-up step of fsdp2-hsdp) is enough to be named as not."""
    records = schedule({"flat": [1.0], "hpz": [1.0], "fsdp2-hsdp": [1.0]})
    records += schedule({"qwz": [1.0]}, loss=5.5)
    off = next(i for i, r in enumerate(records) if (r.variant, r.step) == ("fsdp2-hsdp", 1))
    records[off] = records[off]._replace(loss=5.0 + 2**-20)
    summaries = bcr.summarize(records, "100mbit", RATE_BITS)
    assert [s.losses_as_flat for s in summaries] == [True, True, False, False]
    (note,) = bcr.exactness_notes(summaries)
    assert "bit for bit: hpz; not: fsdp2-hsdp, qwz" in note


def test_boundness_note_gives_both_floors() -> None:
    records = schedule({"flat": [2.0]}, inter_node_bytes=10_000_000)
    records += schedule({"zero++": [1.0]}, inter_node_bytes=1_000_000)
    (note,) = bcr.boundness_notes(bcr.summarize(records, "100mbit", RATE_BITS), "100mbit")
    assert "0.40 s of flat stage 3's 2.00 s step and 0.04 s of ZeRO++'s 1.00 s" in note


def test_rerender_writes_the_report_from_the_json_alone(tmp_path: Path) -> None:
    records = schedule({"flat": [2.0, 2.0, 2.0], "zero++": [1.0, 1.0, 1.0]})
    context = {"main_rate": "100mbit", "notes": ["base note"], "wall_s": 60.0, "dtype": "fp32",
               "links": {"100mbit": {"describe": "tbf", "rate_bits": RATE_BITS,
                                     "measured_mbit": 90.0}}}  # fmt: skip
    raw = {"100mbit": {"records": [r._asdict() for r in records], "other": []}}
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    js.write_text(json.dumps({"context": context, "raw": raw}))
    assert bc.main(["--rerender", "--md", str(md), "--json", str(js)]) == 0
    report = md.read_text()
    assert "- base note" in report and "MET: ZeRO++ speed-up" in report
    payload = json.loads(js.read_text())
    assert payload["raw"] == raw and payload["context"] == context
    assert [g["met"] for g in payload["goals"]] == [False, True]  # 4000 / 4000 bytes: 1.0


def test_command_line_wants_the_baseline_first() -> None:
    with pytest.raises(SystemExit):
        bc.main(["--variants", "hpz,flat", "--md", "/dev/null", "--json", "/dev/null"])
    with pytest.raises(SystemExit):
        bc.main(["--models", "huge"])


def test_half_precision_note_doubles_the_ratio() -> None:
    records = schedule({"flat": [1.0]}, inter_node_bytes=1_000_000)
    records += schedule({"zero++": [1.0]}, inter_node_bytes=120_000)
    (note,) = bcr.half_precision_notes(bcr.summarize(records, "100mbit", RATE_BITS), "100mbit")
    assert "2 x 0.120 = 0.240 (still within the goal)" in note


def test_the_speedup_bound_is_flat_step_over_the_step_with_only_the_link_time_cut() -> None:
    """At 100 Mbit/s flat stage 3 spent 4.64 s of 6.79 on the link; ZeRO++ needs 0.54 s:
    at most 6.79 / (6.79 - 4.64 + 0.54) = 2.52x. At a link 10x faster: far below 1.5x."""
    assert bcr.speedup_bound(6.79, 4.64, 0.54) == pytest.approx(6.79 / 2.69)
    assert bcr.speedup_bound(5.0, 0.46, 0.05) < bcr.MIN_SPEEDUP
    assert "below the 1.5x goal" in bcr.speedup_bound_note(5.0, 0.46, 0.05)


def test_link_cost_note_measures_flat_against_the_free_link_and_bounds_zeropp() -> None:
    """Flat stage 3 steps in 1.10 s at the rate and 1.00 s with the link free: the link
    makes its step 10% longer; ZeRO++ takes 1.20 s with the link free, so no cut of link
    bytes can make it faster than 1.10 / 1.20 = 0.92x flat there."""
    slow = bcr.summarize(schedule({"flat": [1.1], "zero++": [1.3]}), "1gbit", 1e9)
    free = bcr.summarize(schedule({"flat": [1.0], "zero++": [1.2]}), "40gbit", 40e9)
    (note,) = bcr.link_cost_notes([*slow, *free], "40gbit")
    assert "median step 1.100 s at 1gbit, 1.000 s at 40gbit" in note
    assert "makes its step +10% longer" in note
    assert "at most 0.92x faster than flat at 1gbit (below the 1.5x goal)" in note
    assert bcr.link_cost_notes(slow, "40gbit") == []  # nothing measured with the link free


def test_the_reference_rate_is_reported_but_not_judged(tmp_path: Path) -> None:
    at = {"100mbit": [2.0, 1.0], "40gbit": [1.0, 1.1]}
    context = {"main_rate": "100mbit", "reference_rate": "40gbit", "notes": [], "wall_s": 60.0,
               "dtype": "fp32", "links": {
                   rate: {"describe": "tbf", "rate_bits": bits, "measured_mbit": 90.0}
                   for rate, bits in (("100mbit", RATE_BITS), ("40gbit", 40e9))}}  # fmt: skip
    raw = {
        rate: {
            "records": [r._asdict() for r in schedule({"flat": [f], "zero++": [z]})],
            "other": [],
        }
        for rate, (f, z) in at.items()
    }
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    js.write_text(json.dumps({"context": context, "raw": raw}))
    assert bc.main(["--rerender", "--md", str(md), "--json", str(js)]) == 0
    payload = json.loads(js.read_text())
    assert {g["rate"] for g in payload["goals"]} == {"100mbit"}
    assert any("measured against 40gbit" in n and "+100% longer" in n for n in payload["notes"])
    assert not any(n.startswith("small at 40gbit") for n in payload["notes"])  # not judged
    assert "| small | 40gbit | zero++ |" in md.read_text()


def test_a_failed_reference_launch_keeps_the_rates_measurements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference launch runs last; if it fails (say tc refuses the rate), the report of
    the rates already measured is still written, and says why the link's cost is missing."""
    from tools.cluster import emulated as ec

    def run_rate(args: object, rate: str, folder: Path, variants: object = None) -> object:
        if rate == bc.REFERENCE_RATE:
            raise ec.ClusterUnavailable(f"tc refused {rate}")
        steps = schedule({"flat": [2.0, 2.1], "zero++": [1.0, 1.1]})
        return steps, [], {"describe": "tbf", "rate_bits": RATE_BITS, "measured_mbit": 90.0}

    monkeypatch.setattr(bc, "run_rate", run_rate)
    monkeypatch.setattr(bc, "provenance", lambda dtype: {"precision": "fp32"})
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    argv = ["--rates", "100mbit", "--variants", "flat,zero++", "--md", str(md), "--json", str(js)]
    assert bc.main(argv) == 0
    payload = json.loads(js.read_text())
    assert payload["context"]["reference_rate"] is None
    assert any("reference launch at 40gbit failed" in n for n in payload["context"]["notes"])
    assert [g["rate"] for g in payload["goals"]] == ["100mbit", "100mbit"]


def test_a_peer_that_replaces_torchs_linear_for_the_process_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process; the
    worker builds every variant in one process, so before each variant's steps it checks
    that torch's linear is in place (the DeepSpeed trainer installs its own only around
    its forward)."""
    import torch

    from tools.cluster import worker

    worker.check_torch_linear()
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="replaced it for the whole process"):
        worker.check_torch_linear()
