"""Markdown tables and PNG charts of tools/peers/bench.py's results.

``launch_table(report)`` is one launch's table (printed by every launch); ``write_docs``
writes ``docs/benchmarks/peers.md`` and the charts from every launch's JSON and the
largest-model search. Charts need matplotlib (installed by ``nox -s bench`` only); without
it the Markdown is still written and says so.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zero_core.estimate.model_states import model_state_bytes, state_bytes_per_param

MIB = 2**20
# Step time over DDP: issue 8 for stages 1-3, issue 17 added stage 0 (real data parallelism).
TARGETS = {"ours-0": 1.05, "ours-1": 1.05, "ours-2": 1.05, "ours-3": 1.15, "ours-3-in-bwd": 1.15}
# Launches of DDP and the TARGETS variants only (tools.peers.search.GOAL_LAUNCHES): where one
# exists for a (size, N), its step-time goal rows are judged from it.
GOAL_PREFIX = "goal-rows-"
# Largest-model goals of issue 17, in both checkpoint settings: (ours, peer, parameters of
# ours >= factor x the peer's)
LARGEST_GOALS = (
    ("ours-3", "fsdp2", 1.15),
    # the optimizer step fused into backward (12 bytes per parameter / N): like for like
    # against FSDP2 stepping in backward too, and against FSDP2 as it is by default
    ("ours-3-in-bwd", "fsdp2-in-bwd", 1.15),
    ("ours-3-in-bwd", "fsdp2", 1.15),
    ("ours-1", "deepspeed-1", 1.0),
    ("ours-2", "deepspeed-2", 1.0),
    ("ours-3", "ddp", 3.5),
)
PHASES = ("forward", "backward", "step")
# peers-json/ file of each largest-model search: checkpoint mode -> name
SEARCH_FILES = {"none": "largest-n4.json", "full": "largest-n4-checkpoint.json"}
CHECKPOINT_WORDS = {
    "none": "without activation checkpointing",
    "full": "with activation checkpointing (every block, recomputed in backward)",
}


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def paper_model_states_mib(variant: str, psi: int, n: int) -> float | None:
    """The paper's model-state bytes (zero_core.model_state_bytes) for fp32 Adam (params
    4, grads 4, Adam moments 8 = K; no separate fp32 master copy in fp32) per rank, MiB;
    None for a variant it does not describe."""
    in_backward = variant.endswith("-in-bwd")  # no gradient shard held: 12 bytes, not 16
    variant = variant.removesuffix("-in-bwd")
    stage = {"ddp": 0, "zero-redundancy": 1, "fsdp2": 3}.get(variant)
    if variant.startswith(("ours-", "deepspeed-")):
        stage = int(variant.split("-")[1])
    if stage is None:
        return None
    k = state_bytes_per_param(4, "adam")  # 8: float32 parameters are their own masters
    grad_bytes = 0 if in_backward else 4
    states = model_state_bytes(
        psi, n, stage, optimizer_state_bytes=k, param_bytes=4, grad_bytes=grad_bytes
    )
    return states.total / MIB


def ddp_ratios(row: dict[str, Any], report: dict[str, Any]) -> str:
    """'median of per-round ratios (ratio of the medians) [lowest-highest round]' to DDP of
    the same launch (of the same part, for a launch run in parts: ``ddp_median_step_s``)."""
    ddp = next((r for r in report["results"] if r["variant"] == "ddp"), None)
    if ddp is None or row["ratio_to_ddp"] is None:
        return "-"
    ddp_median = row.get("ddp_median_step_s") or ddp["median_step_s"]
    spread = round_spread(row, ddp)
    return f"{row['ratio_to_ddp']:.2f} ({row['median_step_s'] / ddp_median:.2f}){spread}"


def round_spread(row: dict[str, Any], ddp: dict[str, Any]) -> str:
    """' [lowest-highest]' of the per-round ratios to DDP, '' where there is one round or
    they are unknown: a launch written before the rows kept them gives them only where
    the row's DDP is the launch's (round by round, the same rounds)."""
    ratios = row.get("round_ratios_to_ddp")
    if ratios is None and row.get("ddp_median_step_s") in (None, ddp["median_step_s"]):
        mine, theirs = row.get("round_step_s", []), ddp.get("round_step_s", [])
        if len(mine) == len(theirs):
            ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    if not ratios or len(ratios) < 2:
        return ""
    return f" [{min(ratios):.2f}-{max(ratios):.2f}]"


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of what ``values`` sample: the k-th
    lowest and k-th highest value, k the largest with P(the median lies between) >=
    ``confidence`` (the number of values below the median is Binomial(n, 1/2)); None where
    even the lowest and the highest do not reach it (n <= 5 at 0.95)."""
    ordered, n = sorted(values), len(values)
    best = None
    for k in range(1, n // 2 + 1):
        outside = 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if 1 - outside < confidence:
            break
        best = (ordered[k - 1], ordered[n - k])
    return best


def launch_table(report: dict[str, Any]) -> str:
    model = report["model"]
    n, psi = report["world_size"], model["parameters"]
    head = (
        f"#### N = {n}, GPT {model['layers']} x {model['width']} ({psi / 1e6:.1f}M parameters, "
        f"context {model['context']}, vocabulary {model['vocab_size']}), "
        f"{report['batch_per_rank']} sequences/rank, {report['rounds']} rounds of "
        f"{report['warmup']} + {report['steps']} steps\n"
    )
    rows = [
        head,
        "| variant | step s | / DDP: per round (of medians) | model states MiB (paper) "
        "| params / grads / optim / other MiB | peak RSS increase MiB | comm MiB/step (calls) "
        "| minor faults/step | loss |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in report["results"]:
        s = r["state_bytes"]
        paper = paper_model_states_mib(r["variant"], psi, n)
        parts = " / ".join(
            f"{s[k] / MIB:.0f}" for k in ("parameters", "gradients", "optimizer_states", "other")
        )
        calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r["comm_calls_per_step"].items()))
        rows.append(
            f"| {r['variant']} | {r['median_step_s']:.3f} | {ddp_ratios(r, report)} "
            f"| {s['model_states'] / MIB:.0f} ({_f(paper, '.0f')}) | {parts} "
            f"| {_f(r['rss_increase_mib'], '.0f')} "
            f"| {r['comm_bytes_per_step'] / MIB:.1f} ({calls}) "
            f"| {_f(r.get('minor_faults_per_step'), ',.0f')} | {r['loss']:.4f} |"
        )
    if report.get("deepspeed_error"):
        rows.append(f"\nDeepSpeed left out: `{report['deepspeed_error']}`")
    return "\n".join(rows)


READING = [
    "\n## Reading the figures\n",
    "- The paper's model-state formula here is for fp32 Adam: parameters 4Ψ, gradients 4Ψ, "
    "Adam's two moments 8Ψ bytes, partitioned by stage; there is no separate fp32 master copy "
    "in fp32 training. A framework that keeps one anyway shows it under optimizer states "
    "(`optim`). Ours keep none: with fp32 parameters the master weights are the parameters "
    "(stage 0), this rank's slice of them (stages 1 and 2) or the compute shard (stage 3). "
    "At stages 2 and 3 our model states exceed FSDP2's and DeepSpeed's by at most 0.21% "
    "(the tables round them equal; the targets compare bytes): parameters of at most 4096 "
    "elements stay whole on every rank, and buckets are padded to a multiple of N.",
    "- DeepSpeed frees `param.grad` once a bucket is reduced and keeps the reduced gradient "
    "partition (and its buckets) inside its optimizer, so its gradients show as 0 and that "
    "memory under `other`, with the rest of what its optimizer object holds; its stage 1 "
    "runs the same code as its stage 2, so it holds less than the paper's stage-1 formula. "
    "`other` of ours is the communicator's staging buffers and the model's buffers.",
    "- Communication is the ring convention of zero_comm.stats for every variant. Broadcast "
    "counts its whole buffer on every rank, so ZeroRedundancyOptimizer's per-parameter "
    "broadcasts of the updated shards count Ψ per rank (a ring all-gather would move "
    "Ψ(N-1)/N). DeepSpeed stages 1 and 2 reduce gradients with all-reduce on this setup "
    "(3Ψ(N-1)/N with the parameter all-gather). DeepSpeed stage 3 counts 2Ψ(N-1)/N, not 3: "
    "consistent with its defaults (stage3_max_reuse_distance 1e9) keeping the parameters "
    "gathered in forward until backward has used them, i.e. gathering once per step.",
    "- Peak RSS increase is the resident memory a variant added at its peak over the "
    "process's baseline just before it was built (one variant alive at a time): model "
    "states plus activations, gathered parameters, communication buffers and allocator "
    "overhead. It is a per-rank figure; the largest rank is shown.",
    "- The machine is shared and has fewer cores than ranks at N = 4, so step times carry "
    "scheduler noise; the two ratios (per round, of the medians) show how much.",
]


# ------------------------------------------------------------------ the whole report
def _load(raw: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The launches (by N, then size), the largest-model searches (without checkpointing
    first) and run.json."""
    launches = [json.loads(p.read_text()) for p in sorted(raw.glob("peers-*.json"))]
    launches.sort(key=lambda r: (r["world_size"], r["model"]["parameters"]))
    searches = []
    for mode, name in SEARCH_FILES.items():
        if (raw / name).exists():
            search = json.loads((raw / name).read_text())
            search.setdefault("checkpoint", mode)  # written before the setting existed
            searches.append(search)
    run_path = raw / "run.json"
    run = json.loads(run_path.read_text()) if run_path.exists() else {}
    return launches, searches, run


def _load_goal_launches(raw: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """The goal-row launches by (parameters, N)."""
    reports = [json.loads(p.read_text()) for p in sorted(raw.glob(f"{GOAL_PREFIX}*.json"))]
    return {(r["model"]["parameters"], r["world_size"]): r for r in reports}


def goal_launch_of(
    report: dict[str, Any], goal_launches: dict[tuple[int, int], dict[str, Any]]
) -> dict[str, Any] | None:
    """The goal-row launch of ``report``'s model and N, if there is one."""
    return goal_launches.get((report["model"]["parameters"], report["world_size"]))


def provenance_warnings(launches: list[dict[str, Any]], run: dict[str, Any]) -> list[str]:
    """A line for each launch of this run that failed (run.json's ``failed_launches``) and
    for each column whose figures come from another run than the first column's (a failed
    launch leaves its previous JSON in place): stale figures are never shown unmarked."""
    lines = [
        f"- **{f['label']}: this run's launch failed** (exit {f['exit']}"
        + ("; 137 = SIGKILL, e.g. the kernel's out-of-memory killer" if f["exit"] == 137 else "")
        + ")"
        for f in run.get("failed_launches", [])
    ]
    for report in launches:
        if len(report.get("part_commands", [])) > 1:
            lines.append(
                f"- {_label(report)} ran in {len(report['part_commands'])} processes per rank "
                "(tools/peers/search.py LAUNCH_PARTS says why): each part timed DDP too, "
                "and every ratio of that column is to the DDP of its own part"
            )
    first = launches[0]
    for report in launches[1:]:
        if (report["git_head"], report["date"][:10]) != (first["git_head"], first["date"][:10]):
            lines.append(
                f"- **{_label(report)}: figures from an earlier run** ({report['date']}, git "
                f"commit {report['git_head']}), not this one: compare that column with care"
            )
    return lines


def search_provenance(run: dict[str, Any], searches: list[dict[str, Any]]) -> str:
    """Where the largest-model tables come from: this run, a search-only run after it, or
    (``--skip-search``) an earlier run, named by the date and commit its JSON records."""
    when = sorted(
        {
            f"{r['date']}, git commit {r['git_head']}"
            for s in searches
            for r in [s, *s["results"]]
            if "date" in r
        }
    )
    if "search_command" in run:
        at = f" ({'; '.join(when)})" if when else ""
        return f"- largest-model search, run again on its own{at}: `{run['search_command']}`"
    if "--skip-search" not in run.get("command", "").split():
        return "- largest-model search: part of the command above"
    origin = (
        "from an earlier run (" + "; ".join(when) + ")"
        if when
        else "from an earlier run, whose JSON does not record when (before the search wrote "
        "its date and commit)"
    )
    skipped = "- largest-model search: **not part of this run** (`--skip-search`)"
    return f"{skipped}: its tables are {origin}"


def goal_rows_provenance(run: dict[str, Any]) -> list[str]:
    """A line naming the goal-row launches' own run (``--goal-rows-only``), if they had one
    after the command above; their dates and commits are in their section."""
    if "goal_rows_command" not in run:
        return []
    failed = run.get("goal_rows_failed_launches", [])
    lost = (
        "; failed: " + ", ".join(f"{f['label']} (exit {f['exit']})" for f in failed)
        if failed
        else ""
    )
    return [f"- goal-row launches, run again on their own: `{run['goal_rows_command']}`{lost}"]


def _label(report: dict[str, Any]) -> str:
    return f"{report['model']['parameters'] / 1e6:.0f}M N={report['world_size']}"


def _pivot(launches: list[dict[str, Any]], title: str, cell: Any) -> list[str]:
    variants: list[str] = []
    for report in launches:
        variants += [r["variant"] for r in report["results"] if r["variant"] not in variants]
    rows = [
        f"\n### {title}\n",
        "| variant | " + " | ".join(map(_label, launches)) + " |",
        "|---|" + "---:|" * len(launches),
    ]
    for variant in variants:
        cells = []
        for report in launches:
            found = [r for r in report["results"] if r["variant"] == variant]
            cells.append(cell(found[0], report) if found else "-")
        rows.append(f"| {variant} | " + " | ".join(cells) + " |")
    return rows


def paper_of(row: dict[str, Any], report: dict[str, Any]) -> float | None:
    return paper_model_states_mib(
        row["variant"], report["model"]["parameters"], report["world_size"]
    )


def _result(report: dict[str, Any], variant: str) -> dict[str, Any] | None:
    return next((r for r in report["results"] if r["variant"] == variant), None)


def largest_goals(search: dict[str, Any]) -> list[str]:
    """LARGEST_GOALS rows of one search: met, missed, or '-' where a side did not run."""
    found = {r["variant"]: r for r in search["results"]}
    setting = "checkpointing" if search["checkpoint"] != "none" else "no checkpointing"
    out = []
    for ours, peer, factor in LARGEST_GOALS:
        mine, theirs = found.get(ours), found.get(peer)
        goal = f"largest model, {ours} >= {factor:g}x {peer}"
        where = f"N={search['world_size']}, {setting}"
        if mine is None or theirs is None or not theirs["parameters"]:
            out.append(f"| {goal} | {where} | not searched | - |")
            continue
        ratio = mine["parameters"] / theirs["parameters"]
        out.append(
            f"| {goal} | {where} | {ratio:.2f}x ({mine['parameters'] / 1e6:.0f}M vs "
            f"{theirs['parameters'] / 1e6:.0f}M) | {'yes' if ratio >= factor else 'NO'} |"
        )
    return out


def largest_table(search: dict[str, Any]) -> list[str]:
    """One search's table: every variant's answer and probes."""
    lines = [
        f"\n## Largest trainable GPT, N = {search['world_size']}, "
        f"{CHECKPOINT_WORDS.get(search['checkpoint'], search['checkpoint'])}\n",
        f"Width {search['width']}, {search['heads']} heads, context {search['context']}, "
        f"{search['batch_per_rank']} sequence per rank, 2 steps, layers searched; memory cap "
        f"{search['budget_mib_per_rank']} MiB per rank ({search['limit']}).\n",
        "| variant | largest layers | parameters | first failing layers | probes "
        "(layers: result, s) | peak RSS increase of the largest, MiB |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in search["results"]:
        probes = "; ".join(
            f"{p['layers']}{' again' if p.get('retry') else ''}: "
            f"{'ok' if p['ok'] else p['how'][:40]}, {p['seconds']:.0f}"
            for p in r["probes"]
        )
        best = [p for p in r["probes"] if p["ok"] and p["layers"] == r["layers"]]
        rss = max(x["rss_increase_mib"] for x in best[0]["ranks"]) if best else None
        lines.append(
            f"| {r['variant']} | {r['layers']} | {r['parameters'] / 1e6:.0f}M "
            f"| {r['first_failing_layers'] or '-'} | {probes} "
            f"| {_f(rss, '.0f')} |"
        )
    return lines


def phase_peak_cell(row: dict[str, Any], _report: dict[str, Any]) -> str:
    """'forward / backward / step' peak increase, MiB, or '-' for a launch without them."""
    peaks = row.get("phase_peaks") or {}
    if not all(p in peaks for p in PHASES):
        return "-"
    return " / ".join(f"{peaks[p]['increase_mib']:.0f}" for p in PHASES)


def targets(
    launches: list[dict[str, Any]],
    searches: list[dict[str, Any]],
    goal_launches: dict[tuple[int, int], dict[str, Any]] | None = None,
) -> list[str]:
    """The issue's targets, each met or missed, figure by figure; a step-time goal from
    the goal-row launch of its (size, N) where there is one, else from the full launch."""
    out = ["\n## Targets (issues 8 and 17)\n", "| target | run | figure | met |"]
    out.append("|---|---|---|---|")
    for report in launches:
        goal = goal_launch_of(report, goal_launches or {})
        for variant, bound in TARGETS.items():
            timed, run = report, _label(report)
            if goal is not None and _result(goal, variant) is not None:
                timed, run = goal, f"{_label(goal)}, goal-row launch ({goal['rounds']} rounds)"
            r = _result(timed, variant)
            if r and r["ratio_to_ddp"] is not None:
                ok = r["ratio_to_ddp"] <= bound
                ddp = _result(timed, "ddp")
                spread = "" if ddp is None else round_spread(r, ddp)
                out.append(
                    f"| {variant} step time <= {bound}x DDP | {run} "
                    f"| {r['ratio_to_ddp']:.2f}x{spread} | {'yes' if ok else 'NO'} |"
                )
        for stage, peers in (
            (1, ("deepspeed-1", "zero-redundancy")),
            (2, ("deepspeed-2",)),
            (3, ("deepspeed-3", "fsdp2")),
        ):
            ours = _result(report, f"ours-{stage}")
            if ours is None:
                continue
            mine = ours["state_bytes"]["model_states"]
            paper = (
                paper_model_states_mib(
                    f"ours-{stage}", report["model"]["parameters"], report["world_size"]
                )
                or 0.0
            )
            out.append(
                f"| ours-{stage} model states = paper | {_label(report)} | "
                f"{mine / MIB:.0f} vs {paper:.0f} MiB "
                f"| {'yes' if mine / MIB <= paper * 1.01 else 'NO'} |"
            )
            for peer in peers:
                theirs = _result(report, peer)
                if theirs is None:
                    continue
                other = theirs["state_bytes"]["model_states"]
                out.append(
                    f"| ours-{stage} model states <= {peer} | {_label(report)} | "
                    f"{mine / MIB:.0f} vs {other / MIB:.0f} MiB "
                    f"| {'yes' if mine <= other else 'NO'} |"
                )
    for search in searches:
        out += largest_goals(search)
    return out


def goal_rows_section(
    launches: list[dict[str, Any]], goal_launches: dict[tuple[int, int], dict[str, Any]]
) -> list[str]:
    """The step-time goal rows from their own launches, beside the full launch's figure."""
    pairs = [
        (rep, goal) for rep in launches if (goal := goal_launch_of(rep, goal_launches)) is not None
    ]
    if not pairs:
        return []
    out = [
        "\n### Step time of the goal rows, from launches of DDP and these variants only\n",
        "Each cell: ratio to DDP as in the step table, from the goal-row launch (its rounds "
        "in the header), with an interval that holds the median of such round ratios with "
        "95% confidence (order statistics: the k-th lowest and highest round, distribution-"
        "free), then the full launch's median ratio (its rounds) for comparison. "
        "A goal-row launch interleaves six variants, so a variant's block and its DDP's are "
        "seconds apart, not minutes: the targets below are judged from it. "
        + "; ".join(
            f"{_label(goal)}: {goal['date']}, git commit {goal['git_head']}" for _, goal in pairs
        ),
        "",
        "| variant | " + " | ".join(f"{_label(g)} ({g['rounds']} rounds)" for _, g in pairs) + " |",
        "|---|" + "---:|" * len(pairs),
    ]
    for variant in TARGETS:
        cells = []
        for rep, goal in pairs:
            mine, full = _result(goal, variant), _result(rep, variant)
            cell = "-" if mine is None else ddp_ratios(mine, goal)
            interval = median_interval((mine or {}).get("round_ratios_to_ddp") or [])
            if interval is not None:
                cell += f", median within {interval[0]:.2f}-{interval[1]:.2f} (95%)"
            if full is not None and full["ratio_to_ddp"] is not None:
                cell += f"; full launch ({rep['rounds']} rounds) {full['ratio_to_ddp']:.2f}"
            cells.append(cell)
        out.append(f"| {variant} | " + " | ".join(cells) + " |")
    return out


def write_docs(out: Path, raw: Path) -> None:
    launches, searches, run = _load(raw)
    if not launches:
        raise SystemExit(f"no peers-*.json under {raw}: run the launches first")
    first = launches[0]
    lines = [
        "# Our ZeRO against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed",
        "",
        "Written by `python -m tools.peers.bench --all` (`nox -s bench`); the raw figures are "
        "in `peers-json/`, the method in the docstrings of tools/peers/bench.py (timing, "
        "memory), tools/peers/trainers.py (what each framework runs, what is counted), "
        "tools/peers/comm_hooks.py (the peers' bytes) and tools/peers/search.py (largest "
        "model).",
        "",
        f"- date: {first['date']}; git commit {first['git_head']} (package sources "
        f"{first['sources']}"
        + (
            "; CHANGED during a launch"
            if any(r["sources_changed_during_run"] for r in launches)
            else ""
        )
        + ")",
        "- uncommitted at the time (tools/, packages/): "
        + (", ".join(f"`{f}`" for f in first.get("uncommitted", [])) or "none"),
        f"- command: `{run.get('command', first['command'])}`"
        + (f" ({run['wall_s'] / 60:.0f} min)" if "wall_s" in run else ""),
        f"- one launch: `{first['command']}`",
        *provenance_warnings(launches, run),
        search_provenance(run, searches),
        *goal_rows_provenance(run),
        f"- machine: {first['machine']['cpu']}, {first['machine']['cpu_count']} cores, "
        f"{first['machine']['memory_gib']} GiB, {first['machine']['system']}, Python "
        f"{first['machine']['python']}; shared with other work (timings are medians)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in first["versions"].items()),
        f"- workload: GPT, vocabulary 256 (bytes of the default corpus), context "
        f"{first['model']['context']}, tied embeddings, fp32, AdamW (lr 1e-4, betas 0.9/0.95, "
        f"weight decay 0.1), gloo, {first['threads']} torch thread per rank, "
        + ", ".join(
            sorted(
                {
                    f"{r['batch_per_rank']} sequence(s) per rank per step at "
                    f"{r['model']['parameters'] / 1e6:.0f}M"
                    for r in launches
                }
            )
        )
        + f"; each block = build + "
        f"{first['warmup']} untimed + {first['steps']} timed steps; interleaved rounds "
        "(order reversed every other round): "
        + ", ".join(
            f"{r['rounds']} at {r['model']['parameters'] / 1e6:.0f}M N={r['world_size']}"
            for r in launches
        ),
        "- sizes: "
        + "; ".join(
            sorted(
                {
                    f"{r['model']['parameters']:,} parameters = "
                    f"{r['model']['layers']} layers x width "
                    f"{r['model']['width']}, {r['model']['heads']} heads"
                    for r in launches
                }
            )
        ),
        f"- buckets: ours and DeepSpeed {first['bucket_numel']:,} elements; DDP 25 MiB "
        "(its default), `gradient_as_bucket_view=True`; FSDP2 one group per block + root",
    ]
    if first.get("deepspeed_error"):
        lines.append(f"- DeepSpeed did not run: `{first['deepspeed_error']}`")
    lines += _pivot(
        launches,
        "Step time: median s; ratio to DDP, the median over rounds of (variant / DDP of the "
        "same round), in brackets the ratio of the two medians, then [the lowest and the "
        "highest round's ratio]: a goal is judged by the median, and a range wider than the "
        "goal's margin says this many rounds cannot tell it",
        lambda r, rep: f"{r['median_step_s']:.3f}; {ddp_ratios(r, rep)}",
    )
    lines += _pivot(
        launches,
        "Model-state bytes per rank, MiB, counted from tensors "
        "(the paper's formula for fp32 Adam, 16Ψ at stage 0)",
        lambda r, rep: (
            f"{r['state_bytes']['model_states'] / MIB:.0f} ({_f(paper_of(r, rep), '.0f')})"
        ),
    )
    lines += _pivot(
        launches,
        "Peak resident memory per rank, MiB: increase over the "
        "pre-build baseline (absolute peak RSS in brackets)",
        lambda r, _: f"{_f(r['rss_increase_mib'], '.0f')} ({r['rss_peak_mib']:.0f})",
    )
    lines += _pivot(
        launches,
        "Bytes communicated per step per rank, MiB (ring convention; "
        "paper 2Ψ(N-1)/N x 4 bytes at stages 0-2, 3Ψ(N-1)/N at stage 3)",
        lambda r, _: f"{r['comm_bytes_per_step'] / MIB:.1f}",
    )
    lines += _pivot(
        launches,
        "Loss after warm-up + timed steps (mean over ranks)",
        lambda r, _: f"{r['loss']:.5f}",
    )
    if any(phase_peak_cell(r, rep) != "-" for rep in launches for r in rep["results"]):
        lines += _pivot(
            launches,
            "Peak resident memory per phase of one step, MiB: forward / backward / step, "
            "each the phase's high-water mark over the pre-build baseline (zero_core."
            "MemoryTracker in the last timed step; largest rank and round)",
            phase_peak_cell,
        )
    det = [rep for rep in launches if _result(rep, "ours-0-det")]
    if det:
        lines += [
            "\n### Cost of deterministic reductions (ours-s-det / ours-s, step time)\n",
            "| stage | " + " | ".join(map(_label, det)) + " |",
            "|---|" + "---:|" * len(det),
        ]
        for stage in range(4):
            cells = []
            for rep in det:
                a, b = _result(rep, f"ours-{stage}-det"), _result(rep, f"ours-{stage}")
                cells.append(f"{a['median_step_s'] / b['median_step_s']:.2f}" if a and b else "-")
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    for search in searches:
        lines += largest_table(search)
    default = raw / "largest-n4-glibc-default.json"
    if default.exists():
        earlier = json.loads(default.read_text())
        lines += [
            "\nThe same search with glibc's default (dynamic) mmap threshold, before it was "
            f"fixed for the probes ({earlier['limit']}): largest layers / parameters per variant: "
            + "; ".join(
                f"{r['variant']} {r['layers']} / {r['parameters'] / 1e6:.0f}M"
                for r in earlier["results"]
            )
            + ". With the dynamic threshold, freed blocks below it stay in the heap, and the "
            "repeated gather/free of our stage 3 kept up to twice the resident memory "
            "(the bench launches above ran with glibc's defaults for every variant).",
        ]
    goal_launches = _load_goal_launches(raw)
    lines += goal_rows_section(launches, goal_launches)
    lines += targets(launches, searches, goal_launches)
    lines += READING
    lines += ["\n## Per launch\n"] + [launch_table(rep) + "\n" for rep in launches]
    if goal_launches:
        lines += ["\n## Per goal-row launch\n"]
        lines += [launch_table(rep) + "\n" for rep in goal_launches.values()]
    charts = draw_charts(out, launches, searches)
    if charts:
        lines += ["\n## Charts\n"] + [f"![{c}]({c})" for c in charts]
    else:
        lines.append("\n(No charts: matplotlib is not installed here; `nox -s bench` has it.)")
    (out / "peers.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'peers.md'} and {len(charts)} charts", file=sys.stderr)


def draw_charts(
    out: Path, launches: list[dict[str, Any]], searches: list[dict[str, Any]]
) -> list[str]:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return []
    names: list[str] = []
    variants = [r["variant"] for r in launches[0]["results"] if not r["variant"].endswith("-det")]
    panels: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
        ("step time / DDP", lambda r: r["ratio_to_ddp"] or 0.0),
        ("model states per rank, MiB", lambda r: r["state_bytes"]["model_states"] / MIB),
        ("peak RSS increase per rank, MiB", lambda r: r["rss_increase_mib"] or 0.0),
        ("communicated per step per rank, MiB", lambda r: r["comm_bytes_per_step"] / MIB),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)))
    width = 0.8 / len(launches)
    for ax, (title, value) in zip(axes, panels, strict=True):
        for k, rep in enumerate(launches):
            rows = [_result(rep, v) for v in variants]
            ys = [0.0 if row is None else value(row) for row in rows]
            ax.bar([i + k * width for i in range(len(variants))], ys, width, label=_label(rep))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(variants))], variants, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].legend(fontsize=8, ncol=len(launches))
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=90)
    plt.close(fig)
    names.append("peers.png")
    if searches:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        searched = list(dict.fromkeys(r["variant"] for s in searches for r in s["results"]))
        width = 0.8 / len(searches)
        for k, search in enumerate(searches):
            found = {r["variant"]: r["parameters"] / 1e6 for r in search["results"]}
            ax.bar(
                [i + k * width for i in range(len(searched))],
                [found.get(v, 0.0) for v in searched],
                width,
                label=f"checkpoint {search['checkpoint']}, "
                f"{search['budget_mib_per_rank']} MiB per rank",
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(searched))], searched, fontsize=8)
        ax.set_ylabel("parameters, millions")
        ax.legend(fontsize=8)
        ax.set_title(
            f"largest GPT trained, N = {searches[0]['world_size']}",
            fontsize=10,
        )
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "peers-largest.png", dpi=90)
        plt.close(fig)
        names.append("peers-largest.png")
    return names
