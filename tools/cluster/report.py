"""The cluster benchmark's report: step records, their summaries, the goals, the notes and the
markdown (tools/cluster/bench.py runs the launches and writes what this module makes).

Per step of a variant the worker's rank 0 writes one record (:class:`StepRecord`, read by
:func:`parse_records`):

- ``step_s``: the slowest rank's time from leaving a world barrier to the end of the
  optimizer step (forward, backward with the gradient reduction, step, the gathers).
- ``intra_node_bytes`` / ``inter_node_bytes``: what the variant's communicators sent in the
  step, summed over ranks, in zero_comm.stats' ring convention (as zero-train's
  metrics.jsonl has them); FSDP2's are its torch.distributed calls, split by the same rule.
- ``loss``: the mean over ranks of the step's loss.

Reported (:func:`summarize`): the median step time over the timed steps with min/max and the
interquartile range; the speed-up over flat stage 3 as the median over rounds of
(flat's median step / this variant's median step, both in the same round); bytes per step;
the loss after the last step; the *link floor*, inter-node bytes per step / 2 directions /
the rate: the step time if the link alone limited it (a floor far below the step time
means the step is bound by the CPU, not the link). Goals (:func:`check_goals`, at every
rate): ZeRO++ together sends at most 0.3x flat stage 3's inter-node bytes and steps at least
1.5x faster; beside them, the most any cut of link time could give (:func:`speedup_bound`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

BASELINE = "flat"  # the variant every ratio is to: flat stage 3
ZEROPP = "zero++"  # the variant the goals judge
MAX_INTER_RATIO = 0.3  # ZeRO++ inter-node bytes / flat stage 3's, at most
MIN_SPEEDUP = 1.5  # flat stage 3's step time / ZeRO++'s, at least, at each rate
MB = 1e6


# -- records ------------------------------------------------------------------------------------


class StepRecord(NamedTuple):
    """One step of one variant, as the worker's rank 0 writes it (a JSON line).

    ``round`` is -1 for the untimed warm-up steps; ``step`` counts the variant's steps from 0
    (its batches and learning rate are zero-train's for that step)."""

    model: str
    variant: str
    round: int
    step: int
    step_s: float
    loss: float
    intra_node_bytes: int
    inter_node_bytes: int

    @property
    def timed(self) -> bool:
        return self.round >= 0


def parse_records(lines: Iterable[str]) -> tuple[list[dict[str, Any]], list[StepRecord]]:
    """(other records, step records) of a worker's JSON lines, each in file order.

    A step record is a JSON object with every field of :class:`StepRecord` (more are
    ignored); any other object (the launch's description, a model's) is returned as is.
    Blank lines are skipped; a line that is not a JSON object raises ValueError naming it."""
    others: list[dict[str, Any]] = []
    steps: list[StepRecord] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"record line {number} is not JSON ({exc}): {line[:120]!r}") from exc
        if not isinstance(record, dict):
            raise ValueError(f"record line {number} is not a JSON object: {line[:120]!r}")
        if "step_s" in record:
            steps.append(StepRecord(**{f: record[f] for f in StepRecord._fields}))
        else:
            others.append(record)
    return others, steps


# -- statistics ---------------------------------------------------------------------------------


class Spread(NamedTuple):
    """Median, extremes and quartiles of some samples."""

    median: float
    low: float
    high: float
    q1: float
    q3: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("Spread.of: no samples (was every step a warm-up step?)")
        ordered = sorted(samples)
        if len(ordered) == 1:
            q1 = q3 = ordered[0]
        else:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        return cls(statistics.median(ordered), ordered[0], ordered[-1], q1, q3)


class VariantSummary(NamedTuple):
    """One variant of one model at one rate; ratios are to flat stage 3's (``BASELINE``)."""

    rate: str
    model: str
    variant: str
    steps_timed: int
    steps_total: int
    step_s: Spread
    speedup: Spread | None  # over rounds: flat's round median / this variant's
    intra_node_bytes: float  # per step, summed over ranks (median over timed steps)
    inter_node_bytes: float
    inter_ratio: float | None  # this variant's inter-node bytes / flat's
    bytes_constant: bool  # every timed step sent the same bytes
    final_loss: float
    link_floor_s: float  # inter-node bytes / 2 directions / rate: the link's time alone
    losses_as_flat: bool | None  # every step's loss is flat's at that step, bit for bit


def summarize(records: Sequence[StepRecord], rate: str, rate_bits: float) -> list[VariantSummary]:
    """Every (model, variant) of one rate's records, in order of first appearance.

    Needs the baseline ``flat`` for the ratios (None without it); a round where either side
    has no timed step does not count towards the speed-up."""
    if rate_bits <= 0:
        raise ValueError(f"summarize: rate_bits={rate_bits} must be positive")
    keys = list(dict.fromkeys((r.model, r.variant) for r in records))
    by_key = {k: [r for r in records if (r.model, r.variant) == k] for k in keys}

    def round_medians(model: str, variant: str) -> dict[int, float]:
        rounds: dict[int, list[float]] = {}
        for r in by_key.get((model, variant), []):
            if r.timed:
                rounds.setdefault(r.round, []).append(r.step_s)
        return {k: statistics.median(v) for k, v in rounds.items()}

    out = []
    for model, variant in keys:
        mine = by_key[(model, variant)]
        timed = [r for r in mine if r.timed]
        if not timed:
            raise ValueError(f"{model}/{variant}: no timed steps (only warm-up) in the records")
        base = round_medians(model, BASELINE)
        own = round_medians(model, variant)
        speedups = [base[k] / own[k] for k in sorted(own) if k in base and own[k] > 0]
        inter = statistics.median(r.inter_node_bytes for r in timed)
        base_timed = [r for r in by_key.get((model, BASELINE), []) if r.timed]
        base_inter = statistics.median(r.inter_node_bytes for r in base_timed) if base_timed else 0
        last = max(mine, key=lambda r: r.step)
        base_losses = {r.step: r.loss for r in by_key.get((model, BASELINE), [])}
        as_flat = all(base_losses.get(r.step) == r.loss for r in mine) if base_losses else None
        out.append(
            VariantSummary(
                rate=rate,
                model=model,
                variant=variant,
                steps_timed=len(timed),
                steps_total=len(mine),
                step_s=Spread.of([r.step_s for r in timed]),
                speedup=Spread.of(speedups) if speedups else None,
                intra_node_bytes=statistics.median(r.intra_node_bytes for r in timed),
                inter_node_bytes=inter,
                inter_ratio=inter / base_inter if base_inter else None,
                bytes_constant=len({(r.intra_node_bytes, r.inter_node_bytes) for r in timed}) == 1,
                final_loss=last.loss,
                link_floor_s=inter / 2 * 8 / rate_bits,
                losses_as_flat=as_flat,
            )
        )
    return out


def summary_dict(s: VariantSummary) -> dict[str, Any]:
    out = s._asdict()
    out["step_s"] = s.step_s._asdict()
    out["speedup"] = None if s.speedup is None else s.speedup._asdict()
    return out


# -- goals and notes ----------------------------------------------------------------------------


class GoalVerdict(NamedTuple):
    """One goal of issue 16, item 8, for one model at one rate."""

    goal: str
    model: str
    rate: str
    value: float | None  # None: not measured (a variant missing)
    threshold: float
    met: bool

    def line(self) -> str:
        shown = "not measured" if self.value is None else f"{self.value:.3f}"
        return (
            f"{'MET' if self.met else 'NOT MET'}: {self.goal}, {self.model} at {self.rate}: "
            f"{shown} (goal {'<=' if 'bytes' in self.goal else '>='} {self.threshold})"
        )


def check_goals(summaries: Sequence[VariantSummary], rate: str) -> list[GoalVerdict]:
    """ZeRO++'s two goals for every model measured at ``rate``: inter-node bytes at most
    MAX_INTER_RATIO of flat stage 3's, and a speed-up (same-round median) of at least
    MIN_SPEEDUP. A goal whose numbers are missing is not met."""
    verdicts = []
    models = list(dict.fromkeys(s.model for s in summaries if s.rate == rate))
    for model in models:
        zpp = [s for s in summaries if (s.rate, s.model, s.variant) == (rate, model, ZEROPP)]
        ratio = zpp[0].inter_ratio if zpp else None
        speedup = zpp[0].speedup.median if zpp and zpp[0].speedup else None
        verdicts.append(
            GoalVerdict("ZeRO++ inter-node bytes / flat stage 3's", model, rate, ratio,
                        MAX_INTER_RATIO, ratio is not None and ratio <= MAX_INTER_RATIO)
        )  # fmt: skip
        verdicts.append(
            GoalVerdict("ZeRO++ speed-up over flat stage 3 (step time ratio)", model, rate,
                        speedup, MIN_SPEEDUP, speedup is not None and speedup >= MIN_SPEEDUP)
        )  # fmt: skip
    return verdicts


def exactness_notes(summaries: Sequence[VariantSummary]) -> list[str]:
    """Per rate and model: which variants had flat stage 3's loss at every step, bit for bit
    (the lossless ones should: hybrid sharding, hpZ) and which did not (the quantized ones)."""
    notes = []
    for rate, model in dict.fromkeys((s.rate, s.model) for s in summaries):
        others = [
            s
            for s in summaries
            if (s.rate, s.model) == (rate, model)
            and s.variant != BASELINE
            and s.losses_as_flat is not None
        ]
        if not others:
            continue
        same = [s.variant for s in others if s.losses_as_flat]
        other = [s.variant for s in others if not s.losses_as_flat]
        notes.append(
            f"{model} at {rate}: every step's loss equal to flat stage 3's, bit for bit: "
            f"{', '.join(same) or 'none'}; not: {', '.join(other) or 'none'}"
        )
    return notes


def boundness_notes(summaries: Sequence[VariantSummary], rate: str) -> list[str]:
    """Per model at ``rate``: how much of flat stage 3's and ZeRO++'s median steps the link
    alone would take; the rest is computation and waiting for the shared CPU."""
    notes = []
    for model in dict.fromkeys(s.model for s in summaries if s.rate == rate):
        pair = {s.variant: s for s in summaries if (s.rate, s.model) == (rate, model)}
        if BASELINE not in pair or ZEROPP not in pair:
            continue
        flat, zpp = pair[BASELINE], pair[ZEROPP]
        notes.append(
            f"{model} at {rate}: the link alone would take {flat.link_floor_s:.2f} s of flat "
            f"stage 3's {flat.step_s.median:.2f} s step and {zpp.link_floor_s:.2f} s of "
            f"ZeRO++'s {zpp.step_s.median:.2f} s; the rest is computation (quantization "
            "included) and waiting for the shared CPU, which ZeRO++ does not shrink. "
            f"{speedup_bound_note(flat.step_s.median, flat.link_floor_s, zpp.link_floor_s)}"
        )
    return notes


def speedup_bound(flat_step_s: float, flat_floor_s: float, zpp_floor_s: float) -> float:
    """About the most ZeRO++ could speed flat stage 3 up by cutting link time alone
    (Amdahl): flat's step less its link floor, plus ZeRO++'s floor, with no cost added for
    the quantization and the link time taken as not overlapped. Approximate: the floors
    count the collectives' payload, not TCP's and gloo's overhead on the wire (the link
    carries about a quarter more), so a link-bound run can beat it somewhat."""
    return flat_step_s / max(flat_step_s - flat_floor_s + zpp_floor_s, 1e-12)


def speedup_bound_note(flat_step_s: float, flat_floor_s: float, zpp_floor_s: float) -> str:
    bound = speedup_bound(flat_step_s, flat_floor_s, zpp_floor_s)
    verdict = "below" if bound < MIN_SPEEDUP else "at or above"
    return (
        f"Bound: were the link time all that changed, ZeRO++ could be about {bound:.2f}x "
        f"faster here ({verdict} the {MIN_SPEEDUP}x goal; payload bytes only, so approximate)"
    )


def link_cost_notes(summaries: Sequence[VariantSummary], reference: str) -> list[str]:
    """Per model and judged rate: flat stage 3's median step there against its step at
    ``reference`` (a link with no real limit), which is what the link costs it, measured;
    and the most a cut of link bytes could give, flat's step at the rate over ZeRO++'s with
    the link free. Medians of separate launches (no same-round pairing): approximate."""
    notes = []
    at_reference = {(s.model, s.variant): s for s in summaries if s.rate == reference}
    for s in summaries:
        if s.rate == reference or s.variant != BASELINE:
            continue
        free_flat = at_reference.get((s.model, BASELINE))
        free_zpp = at_reference.get((s.model, ZEROPP))
        if free_flat is None:
            continue
        flat, free = s.step_s.median, free_flat.step_s.median
        note = (
            f"{s.model} at {s.rate}, measured against {reference} (the link with no real "
            f"limit): flat stage 3's median step {flat:.3f} s at {s.rate}, {free:.3f} s at "
            f"{reference}, so the link makes its step {flat / free - 1:+.0%} longer"
        )
        if free_zpp is not None:
            ceiling = flat / free_zpp.step_s.median
            verdict = "below" if ceiling < MIN_SPEEDUP else "at or above"
            note += (
                f"; ZeRO++'s step with the link free is {free_zpp.step_s.median:.3f} s, so "
                f"cutting link bytes could make it at most {ceiling:.2f}x faster than flat "
                f"at {s.rate} ({verdict} the {MIN_SPEEDUP}x goal)"
            )
        notes.append(note)
    return notes


def derived_notes(summaries: Sequence[VariantSummary], main_rate: str, dtype: str) -> list[str]:
    """The report's notes that follow from the numbers."""
    rates = list(dict.fromkeys(s.rate for s in summaries))
    notes = exactness_notes(summaries)
    notes += [n for rate in rates for n in boundness_notes(summaries, rate)]
    return notes + (half_precision_notes(summaries, main_rate) if dtype == "fp32" else [])


def half_precision_notes(summaries: Sequence[VariantSummary], rate: str) -> list[str]:
    """What an fp32 run implies for ZeRO++'s byte goal at 16-bit parameters (the paper's
    baseline): flat stage 3's bytes halve, while qwZ's int8 and qgZ's int4 payloads keep their
    size, so the ratio is at most twice the fp32 one."""
    return [
        f"{s.model}: measured in fp32, where qwZ and qgZ compress 4x and 8x (2x and 4x against "
        f"16-bit parameters): with bf16 parameters ZeRO++'s inter-node ratio would be at most "
        f"2 x {s.inter_ratio:.3f} = {2 * s.inter_ratio:.3f} "
        f"({'still' if 2 * s.inter_ratio <= MAX_INTER_RATIO else 'no longer'} within the goal)"
        for s in summaries
        if s.rate == rate and s.variant == ZEROPP and s.inter_ratio is not None
    ]


# -- the report ---------------------------------------------------------------------------------

TABLE_HEADER = (
    "| model | rate | variant | step s: median [min-max] (IQR) | speed-up vs flat, same round: "
    "median [min-max] | inter-node MB/step | x flat | intra-node MB/step | link floor s "
    "(share of step) | loss after N steps |\n"
    "|---|---|---|---|---|---:|---:|---:|---:|---|"
)


def table_row(s: VariantSummary) -> str:
    """One markdown row of :data:`TABLE_HEADER`."""
    step = s.step_s
    speed = (
        "-"
        if s.speedup is None
        else f"{s.speedup.median:.2f}x [{s.speedup.low:.2f}-{s.speedup.high:.2f}]"
    )
    ratio = "-" if s.inter_ratio is None else f"{s.inter_ratio:.3f}"
    share = s.link_floor_s / step.median if step.median > 0 else math.nan
    vary = "" if s.bytes_constant else " (varies)"
    return (
        f"| {s.model} | {s.rate} | {s.variant} | {step.median:.3f} [{step.low:.3f}-"
        f"{step.high:.3f}] ({step.q1:.3f}-{step.q3:.3f}) | {speed} | "
        f"{s.inter_node_bytes / MB:.3f}{vary} | {ratio} | {s.intra_node_bytes / MB:.3f} | "
        f"{s.link_floor_s:.3f} ({share:.0%}) | {s.final_loss:.6f} ({s.steps_total}) |"
    )


def markdown_table(summaries: Sequence[VariantSummary]) -> str:
    return "\n".join([TABLE_HEADER, *(table_row(s) for s in summaries)])


def render_report(
    summaries: Sequence[VariantSummary],
    verdicts: Sequence[GoalVerdict],
    context: dict[str, Any],
) -> str:
    """docs/benchmarks/cluster.md: how it was run (``context``), the table, the goals."""
    notes = "\n".join(f"- {n}" for n in context.get("notes", []))
    links = "\n".join(
        f"- {rate}: {info['describe']}; measured TCP h0->h1 {info['measured_mbit']:.1f} Mbit/s; "
        f"the launch took {info.get('launch_s', 0):.0f} s; load average (1, 5, 15 min) before it "
        f"{_loads(info.get('load_before'))}, after {_loads(info.get('load_after'))}; the link "
        f"carried {info.get('link_bytes', 0) / MB:.1f} MB both ways in the launch, of which the "
        f"steps' counted inter-node bytes {info.get('counted_inter_node_bytes', 0) / MB:.1f} MB"
        for rate, info in context.get("links", {}).items()
    )
    return f"""# Across nodes: flat ZeRO-3, hybrid sharding, ZeRO++ and FSDP2's HSDP

Generated by `{context.get("command", "python -m tools.cluster.bench")}`
on {context.get("date", "?")} (commit {context.get("commit", "?")},
sources {context.get("sources", "?")}); the whole run took
{context.get("wall_s", 0) / 60:.1f} minutes. Raw numbers: `cluster.json` beside this file.

Cluster: tools/cluster/emulated.py, 2 hosts (network namespaces) x 2 ranks, torchrun
`--nnodes 2`, gloo, one torch thread per rank, on a machine of {context.get("cpus", "?")} CPU
cores ({context.get("cpu_model", "model not recorded")}) shared by the 4 ranks (and by other
work). Link per rate:
{links}

Training: {context.get("training", "")}

Schedule per model: {context.get("schedule", "")}

Columns: step time over the timed steps; speed-up = flat's median step time / this
variant's in the same round, the median over rounds [min-max]; bytes per step summed over
ranks in zero_comm.stats' ring convention (MB = 1e6 bytes); x flat = inter-node bytes /
flat stage 3's; link floor = inter-node bytes / 2 directions / the rate, the step time
if the link alone limited it, and its share of the median step (low shares: CPU-bound);
loss = mean over ranks after the variant's last step (N steps in all, the same batches).

{markdown_table(summaries)}

## Goals (issue 16, item 8), judged at every rate but the reference one

{chr(10).join(f"- {v.line()}" for v in verdicts)}

## Notes

{notes}
"""


def _loads(loads: Sequence[float] | None) -> str:
    return "?" if not loads else "/".join(f"{x:.1f}" for x in loads)
