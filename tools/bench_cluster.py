#!/usr/bin/env python
"""Flat ZeRO-3, hybrid sharding and ZeRO++ on the emulated two-node cluster (issue 16, item 8).

    python tools/bench_cluster.py                 # what `nox -s cluster` runs (root only):
                                                  # docs/benchmarks/cluster.md and .json
    python tools/bench_cluster.py --rates 100mbit --models small --rounds 2 --steps 2 \\
        --md /tmp/c.md --json /tmp/c.json        # a quick look
    python tools/bench_cluster.py --rerender      # the report again from cluster.json's
                                                  # raw records (no cluster, no root)

Two hosts (tools/emulated_cluster.py: network namespaces, a veth pair rate-limited by tbf
per direction), two ranks on each, launched by torchrun ``--nnodes 2`` on gloo. For each
rate in ``--rates`` (the first is the *main* rate, where the goals are judged) one cluster
is built and one launch of tools/bench_cluster_worker.py trains every model of ``--models``
with every variant of ``--variants``, all stage 3, deterministic communicators (zero-train's
default), from the same seed on the same batches:

    flat        zero-train --stage 3
    hybrid      --shard-group 2                 (MiCS / HSDP: states over one node's ranks)
    hpz         --hpz 2                         (ZeRO++ hpZ: backward gathers inside a node)
    qwz         --quantize-weights              (ZeRO++ qwZ: int8 forward gathers)
    qgz         --quantize-gradients int4       (ZeRO++ qgZ: int4 hierarchical all-to-all)
    zero++      --hpz 2 --quantize-weights --quantize-gradients int4
    fsdp2-hsdp  PyTorch FSDP2, fully_shard on a 2-D DeviceMesh (replicate=2, shard=2)
    deepspeed-hpz  DeepSpeed stage 3, zero_hpz_partition_size 2 (its ZeRO++ hpZ), fp32;
                in the default --variants only where DeepSpeed is importable

Why one launch per rate and not one zero-train run per variant and round: a launch (4 ranks
and 2 launchers importing torch on this 2-core machine) costs tens of seconds, which would
spend the benchmark's time budget on start-up. The worker runs zero-train's own pieces
instead (its option parser, model, batches, learning-rate schedule, engine configuration),
every variant's engine on a communicator of its own, built once and kept for the launch.

Schedule inside a launch, per model: ``--warmup`` untimed steps of every variant, then
``--rounds`` rounds (``--other-rounds`` at the rates after the first) of ``--steps`` timed
steps of every variant, the variant order rotated by one each round (:func:`variant_order`),
so that drift in the machine's load hits every variant alike. Every variant trains
``warmup + rounds x steps`` steps in all, on the same batches, so the final losses
compare. Per step (one record, :func:`parse_records`):

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

import argparse
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
WORKER = TOOLS / "bench_cluster_worker.py"

FSDP2_HSDP = "fsdp2-hsdp"
DEEPSPEED_HPZ = "deepspeed-hpz"
# name -> zero-train flags (on top of --stage 3); None: not ours (FSDP2's HSDP, DeepSpeed's
# hpZ: the worker builds those itself, from the same zero-train options).
VARIANTS: dict[str, list[str] | None] = {
    "flat": [],
    "hybrid": ["--shard-group", "2"],
    "hpz": ["--hpz", "2"],
    "qwz": ["--quantize-weights"],
    "qgz": ["--quantize-gradients", "int4"],
    "zero++": ["--hpz", "2", "--quantize-weights", "--quantize-gradients", "int4"],
    FSDP2_HSDP: None,
    DEEPSPEED_HPZ: None,
}
BASELINE = "flat"
ZEROPP = "zero++"
# name -> zero-train model flags: the default GPT, and one ~8x its parameters.
MODELS: dict[str, list[str]] = {
    "small": ["--model", "small"],
    "large": ["--model", "small", "--layers", "8", "--width", "256"],
}
DEFAULT_RATES = ("100mbit", "1gbit")
MAX_INTER_RATIO = 0.3  # ZeRO++ inter-node bytes / flat stage 3's, at most
MIN_SPEEDUP = 1.5  # flat stage 3's step time / ZeRO++'s, at least, at each rate
MB = 1e6


# -- the schedule -------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def default_variants(dtype: str = "fp32") -> list[str]:
    """Every variant, less deepspeed-hpz where DeepSpeed is not installed or not fp32."""
    runs_deepspeed = dtype == "fp32" and deepspeed_available()
    return [v for v in VARIANTS if v != DEEPSPEED_HPZ or runs_deepspeed]


def variant_order(variants: Sequence[str], round_index: int) -> list[str]:
    """Round ``round_index``'s order: ``variants`` rotated left by the round's index, so over
    len(variants) rounds every variant runs once in every position."""
    if not variants:
        raise ValueError("variant_order: give at least one variant")
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


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
    """The most ZeRO++ could speed flat stage 3 up by cutting link time alone (Amdahl):
    flat's step less its link floor, plus ZeRO++'s floor, with no cost added for the
    quantization; the link time is taken as not overlapped, so this is an upper bound."""
    return flat_step_s / max(flat_step_s - flat_floor_s + zpp_floor_s, 1e-12)


def speedup_bound_note(flat_step_s: float, flat_floor_s: float, zpp_floor_s: float) -> str:
    bound = speedup_bound(flat_step_s, flat_floor_s, zpp_floor_s)
    verdict = "below" if bound < MIN_SPEEDUP else "at or above"
    return (
        f"Bound: were the link time all that changed, ZeRO++ could be at most {bound:.2f}x "
        f"faster here ({verdict} the {MIN_SPEEDUP}x goal)"
    )


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

Generated by `{context.get("command", "python tools/bench_cluster.py")}`
on {context.get("date", "?")} (commit {context.get("commit", "?")},
sources {context.get("sources", "?")}); the whole run took
{context.get("wall_s", 0) / 60:.1f} minutes. Raw numbers: `cluster.json` beside this file.

Cluster: tools/emulated_cluster.py, 2 hosts (network namespaces) x 2 ranks, torchrun
`--nnodes 2`, gloo, one torch thread per rank, on a machine of {context.get("cpus", "?")} CPU
cores shared by the 4 ranks (and by other work). Link per rate:
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

## Goals (issue 16, item 8), judged at every rate

{chr(10).join(f"- {v.line()}" for v in verdicts)}

## Notes

{notes}
"""


def _loads(loads: Sequence[float] | None) -> str:
    return "?" if not loads else "/".join(f"{x:.1f}" for x in loads)


# -- running it ---------------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace, records: Path, rounds: int) -> list[str]:
    """The worker's command line (after torchrun's own arguments)."""
    return [
        str(WORKER), "--records", str(records), "--models", ",".join(args.models),
        "--variants", ",".join(args.variants), "--rounds", str(rounds),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
        "--batch-size", str(args.batch_size),
    ]  # fmt: skip


def deepspeed_note(variants: Sequence[str] = ()) -> str:
    """Whether DeepSpeed's zero_hpz_partition_size ran beside hpZ (``variants``), or why not."""
    if not deepspeed_available():
        return (
            "DeepSpeed's `zero_hpz_partition_size` was not run beside hpZ: DeepSpeed is not "
            f"installed in this environment ({sys.executable})"
        )
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("deepspeed")
    except PackageNotFoundError:
        release = "?"
    if DEEPSPEED_HPZ not in variants:
        return (
            f"DeepSpeed {release} is importable here, but {DEEPSPEED_HPZ} was left out of "
            "--variants: `zero_hpz_partition_size` was not run"
        )
    return (
        f"{DEEPSPEED_HPZ}: DeepSpeed {release}'s ZeRO stage 3 with `zero_hpz_partition_size` "
        "2 (hpZ groups: the two ranks of a node), fp32, gloo, its CPU accelerator; the same "
        "GPT, initial values, batches, torch AdamW, schedule and clipping as fsdp2-hsdp; "
        "`stage3_max_reuse_distance` and `stage3_prefetch_bucket_size` 0 (otherwise it keeps "
        "forward's gathered parameters until backward on these models, and hpZ's backward "
        "gathers do not happen), the other stage 3 sizes our engine's defaults. Its bytes "
        "are its torch.distributed "
        "calls, counted and split as fsdp2-hsdp's"
    )


def run_rate(
    args: argparse.Namespace, rate: str, folder: Path
) -> tuple[list[StepRecord], list[dict[str, Any]], dict[str, Any]]:
    """One cluster at ``rate``, one launch of the worker: (step records, other records,
    the link as built and measured)."""
    import emulated_cluster as ec

    records = folder / f"records-{rate}.jsonl"
    with ec.EmulatedCluster(2, rate, "0") as cluster:
        assert cluster.link is not None
        h0, h1 = cluster.hosts
        measured = cluster.measure_throughput(h0, h1, 4 << 20)
        link = {
            "describe": cluster.link.describe(),
            "rate_bits": cluster.link.rate_bits_per_s,
            "measured_mbit": measured.bits_per_s / 1e6,
        }
        print(f"[bench_cluster] {rate}: {link['describe']}, measured "
              f"{link['measured_mbit']:.1f} Mbit/s; launching", flush=True)  # fmt: skip
        started = time.perf_counter()
        link["load_before"] = os.getloadavg()
        sent0, received0 = cluster.link_bytes(h0)
        rounds = args.rounds if rate == args.rates[0] else args.other_rounds
        results = cluster.run_torchrun(
            worker_argv(args, records, rounds), ranks_per_node=2, timeout_s=args.timeout
        )
        link["launch_s"] = round(time.perf_counter() - started, 1)
        link["load_after"] = os.getloadavg()
        sent1, received1 = cluster.link_bytes(h0)
        # Everything that crossed the link in the launch, both ways, headers included: the
        # counted inter-node bytes of every step plus start-up, barriers and gathers.
        link["link_bytes"] = sent1 - sent0 + received1 - received0
    for r in results:
        sys.stdout.write(r.stdout)
    others, steps = parse_records(records.read_text().splitlines())
    link["counted_inter_node_bytes"] = sum(r.inter_node_bytes for r in steps)
    return steps, others, link


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--rates", default=",".join(DEFAULT_RATES),
                        help="tc rates, comma-separated; the first is the main rate")  # fmt: skip
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--variants", help="the first is the baseline; default: "
                        f"{','.join(VARIANTS)} ({DEEPSPEED_HPZ} with DeepSpeed, fp32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="at the main rate")
    parser.add_argument("--other-rounds", type=int, default=2, help="at the other rates")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--batch-size", type=int, default=16, help="global, zero-train's default")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks" / "cluster.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "benchmarks" / "cluster.json")
    parser.add_argument("--rerender", action="store_true",
                        help="no run: write --md again from --json's raw records")  # fmt: skip
    args = parser.parse_args(argv)
    args.rates = args.rates.split(",")
    args.models = args.models.split(",")
    args.variants = (args.variants or ",".join(default_variants(args.dtype))).split(",")
    unknown = [m for m in args.models if m not in MODELS] + [
        v for v in args.variants if v not in VARIANTS
    ]
    if unknown:
        parser.error(f"unknown {unknown}: models are {list(MODELS)}, variants {list(VARIANTS)}")
    if DEEPSPEED_HPZ in args.variants and not args.rerender:
        if not deepspeed_available():
            parser.error(f"{DEEPSPEED_HPZ} needs DeepSpeed, not installed for {sys.executable}")
        if args.dtype != "fp32":
            parser.error(f"{DEEPSPEED_HPZ} runs fp32 only (was tried in fp32 alone)")
    if args.variants[0] != BASELINE:
        parser.error(f"--variants must start with the baseline {BASELINE!r}")
    if min(args.rounds, args.other_rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--rounds, --other-rounds and --steps must be at least 1, --warmup >= 0")

    if args.rerender:
        payload = json.loads(args.json.read_text())
        write_outputs(args, payload["context"], payload["raw"])
        return 0
    sys.path.insert(0, str(TOOLS))
    import emulated_cluster as ec

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM (a timeout, nox) becomes KeyboardInterrupt: the cluster's ``with`` block then
    # ends the launch's processes and removes the namespaces.
    signal.signal(signal.SIGTERM, stop)
    started = time.perf_counter()
    made = provenance(args.dtype)
    raw: dict[str, Any] = {}
    links: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as folder:
            for rate in args.rates:
                steps, others, link = run_rate(args, rate, Path(folder))
                links[rate] = link
                raw[rate] = {"records": [s._asdict() for s in steps], "other": others}
    except ec.ClusterUnavailable as exc:
        print(f"bench_cluster: skipped: emulated cluster unavailable: {exc}", flush=True)
        return 0
    wall_s = time.perf_counter() - started
    launches = (o["launch"] for r in raw.values() for o in r["other"] if "launch" in o)
    launch: dict[str, Any] = next(launches, {})
    write_outputs(args, report_context(args, argv, links, launch, made, wall_s), raw)
    return 0


def write_outputs(args: argparse.Namespace, context: dict[str, Any], raw: dict[str, Any]) -> None:
    """Summarize ``raw`` (rate -> the launch's records), judge the goals at every rate,
    write --md and --json (the context and raw records as given) and print the table."""
    summaries = [
        summary
        for rate, launch in raw.items()
        for summary in summarize(
            [StepRecord(**r) for r in launch["records"]], rate, context["links"][rate]["rate_bits"]
        )
    ]
    rates = list(dict.fromkeys(s.rate for s in summaries))
    verdicts = [v for rate in rates for v in check_goals(summaries, rate)]
    notes = derived_notes(summaries, context["main_rate"], context.get("dtype", "fp32"))
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(
        render_report(summaries, verdicts, {**context, "notes": [*context["notes"], *notes]})
    )
    payload = {
        "context": context,
        "summaries": [summary_dict(s) for s in summaries],
        "goals": [v._asdict() for v in verdicts],
        "notes": notes,
        "raw": raw,
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(markdown_table(summaries))
    for v in verdicts:
        print(v.line())
    print(f"wrote {args.md} and {args.json}; the run took {context['wall_s'] / 60:.1f} min")


def summary_dict(s: VariantSummary) -> dict[str, Any]:
    out = s._asdict()
    out["step_s"] = s.step_s._asdict()
    out["speedup"] = None if s.speedup is None else s.speedup._asdict()
    return out


def matmul_seconds(dtype: Any, repeats: int = 3) -> float:
    """Median seconds of one (128 x 256) @ (256 x 256) matmul in ``dtype``, one thread."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(128, 256).to(dtype)
    b = torch.randn(256, 256).to(dtype)
    a @ b  # the first call may set up kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def provenance(dtype: str) -> dict[str, Any]:
    """What the numbers were made with, taken before the launches: the commit, the
    packages' sources digest, uncommitted changes, and how much slower bf16 matmuls are
    than fp32's on this CPU (why fp32 is the default)."""
    import torch
    from provenance import git_head, sources_digest

    import zero_comm
    import zero_core
    import zero_models

    fp32_s, bf16_s = matmul_seconds(torch.float32), matmul_seconds(torch.bfloat16)
    if dtype == "fp32":
        precision = (
            f"fp32, not bf16: bf16 trains on this CPU, but a bf16 matmul took "
            f"{bf16_s / fp32_s:.0f}x the fp32 one's time here ({bf16_s * 1e3:.2f} ms against "
            f"{fp32_s * 1e3:.2f} ms, 128 x 256 x 256, one thread), so bf16 would make every "
            "variant bound by the CPU"
        )
    else:
        precision = (
            f"bf16 parameters (fp32 master weights); a bf16 matmul took {bf16_s / fp32_s:.1f}x "
            "the fp32 one's time here"
        )
    return {
        "commit": git_head(),
        "sources": sources_digest(zero_comm, zero_core, zero_models),
        "git_status": _git_status(),
        "torch": torch.__version__,
        "matmul_s": {"fp32": fp32_s, "bf16": bf16_s},
        "precision": precision,
    }


def report_context(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    links: dict[str, Any],
    launch: dict[str, Any],
    made: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """How the run was made, for the report's text and the JSON."""
    flags = " ".join(sys.argv[1:] if argv is None else argv)
    models = "; ".join(
        f"{name} = zero-train {' '.join(MODELS[name])} ({launch.get('params', {}).get(name, '?')} "
        "parameters)"
        for name in args.models
    )
    return {
        "command": f"python tools/bench_cluster.py {flags}".strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **made,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "wall_s": wall_s,
        "main_rate": args.rates[0],
        "dtype": args.dtype,
        "links": links,
        "launch": launch,
        "training": (
            f"{models}; {made['precision']}; global batch {args.batch_size} "
            f"({args.batch_size // 4} sequences per rank), "
            "AdamW and learning-rate schedule, clipping and seed as zero-train's defaults; "
            "every variant stage 3, zero-train's with deterministic communicators. "
            "fsdp2-hsdp: the same "
            "GPT, initial values, batches, AdamW, schedule and clipping, fully_shard per "
            "block and the root on init_device_mesh('cpu', (2, 2), ('replicate', 'shard'))"
        ),
        "schedule": (
            f"{args.warmup} untimed warm-up steps of every variant, then {args.rounds} rounds "
            f"({args.other_rounds} at the other rates) of {args.steps} timed steps of every "
            "variant, the order rotated by one per round"
        ),
        "notes": [deepspeed_note(args.variants), *launch.get("notes", [])],
    }


def _git_status() -> str:
    try:
        done = subprocess.run(["git", "status", "--short"], capture_output=True, text=True,
                              timeout=10, cwd=ROOT, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
