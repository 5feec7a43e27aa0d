"""The configurations a plan considers, predicted and ranked.

:func:`candidates` spans, for a workload on a cluster: stages 0-3; the optimizer's tier
(none, cpu, disk; stages 1-3) with gradients following it; the parameters' tier (stage 3,
with the optimizer offloaded); on more than one node, hybrid sharding over a node, hpZ over
a node, qwZ and qgZ (int4) alone and together (ZeRO++); activation checkpointing (none,
full); and the bucket and prefetch sizes (ZeroConfig's defaults and 4x them). Delayed
parameter update is tried wherever the optimizer is offloaded.

:func:`rank` orders predictions: those that fit first, then by step time, then by device
memory; :func:`reason` says why the first won.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .cluster import Cluster
from .configuration import PlanConfig
from .step_time import Prediction, predict
from .workload import Workload


def candidates(cluster: Cluster, base: PlanConfig | None = None) -> list[PlanConfig]:
    """Every configuration considered (module docstring); ``base`` gives the fields not
    searched (default PlanConfig())."""
    base = base or PlanConfig()
    per_node = cluster.devices_per_node
    multi = cluster.nodes > 1
    out: list[PlanConfig] = []
    hierarchies: list[dict[str, object]] = [{}]
    if multi:
        hierarchies += [
            {"shard_group": per_node},
            {"hpz": per_node},
            {"quantize_weights": True},
            {"quantize_gradients": "int4"},
            {"hpz": per_node, "quantize_weights": True, "quantize_gradients": "int4"},
        ]
    sizes = [
        {"bucket_numel": base.bucket_numel, "prefetch_numel": base.prefetch_numel},
        {"bucket_numel": 4 * base.bucket_numel, "prefetch_numel": 4 * base.prefetch_numel},
    ]
    for stage in (0, 1, 2, 3):
        optimizer_tiers = ("none",) if stage == 0 else ("none", "cpu", "disk")
        for optimizer_tier in optimizer_tiers:
            param_tiers = ("none", "cpu", "disk") if stage == 3 and optimizer_tier != "none" \
                else ("none",)  # fmt: skip
            dpus = (False, True) if optimizer_tier != "none" else (False,)
            for params_tier, dpu, hierarchy, checkpoint, size in itertools.product(
                param_tiers, dpus, hierarchies, ("none", "full"), sizes
            ):
                if stage < 3 and any(k in hierarchy for k in ("hpz", "quantize_weights")):
                    continue
                if stage < 2 and "quantize_gradients" in hierarchy:
                    continue
                if stage == 0 and hierarchy:
                    continue
                fields = {
                    "shard_group": None, "hpz": 1, "quantize_weights": False,
                    "quantize_gradients": None, **hierarchy, **size,
                }  # fmt: skip
                try:
                    out.append(base.with_(
                        stage=stage, offload_optimizer=optimizer_tier,
                        offload_params=params_tier, delayed_parameter_update=dpu,
                        checkpoint=checkpoint, **fields,
                    ))  # fmt: skip
                except ValueError:
                    continue  # a combination the engine refuses
    return list(dict.fromkeys(out))


class Plan(NamedTuple):
    """A plan: the requested configuration's prediction, and every candidate's, ranked."""

    requested: Prediction
    ranked: list[Prediction]
    reason: str


def rank(predictions: Iterable[Prediction]) -> list[Prediction]:
    """Fitting first, then faster (step times equal to 3 significant digits, the model's
    resolution at best, count as equal), then fewer options, then less device memory."""
    return sorted(predictions, key=lambda p: (
        not p.fits, float(f"{p.step_s:.3g}"), _options(p.config), p.memory.device))  # fmt: skip


def _options(config: PlanConfig) -> int:
    """How many options ``config`` sets away from ZeroConfig's defaults (a simpler
    configuration wins a tie)."""
    default = PlanConfig()
    return sum(
        getattr(config, k) != getattr(default, k)
        for k in config.__dataclass_fields__
        if k != "stage"
    )


def reason(ranked: Sequence[Prediction]) -> str:
    """Why the first of ``ranked`` wins, against the best of another stage and the best
    without its distinguishing options."""
    if not ranked:
        return "no configuration was considered"
    best = ranked[0]
    if not best.fits:
        return f"nothing fits: even the leanest needs more ({best.why_not})"
    t = best.terms
    costs = {
        "compute": t["compute_forward"] + t["compute_backward"],
        "communication": sum(v for k, v in t.items() if k.startswith("link_")),
        "optimizer step": t["optimizer"] + t["gradient_passes"],
        "offload copies and disk": t["copy_to_host"] + t["copy_to_device"] + t["disk_pipeline"]
        + t["disk_parameter_reads"],
    }  # fmt: skip
    main = max(costs, key=lambda k: costs[k])
    text = (f"{best.config.label()} fits ({best.memory.device / 1e9:.3g} GB per device) and "
            f"is fastest at {best.step_s:.4g} s per step; its largest term is {main} "
            f"({costs[main]:.3g} s)")  # fmt: skip
    others = [p for p in ranked[1:] if p.fits and p.config.stage != best.config.stage]
    if others:
        other = others[0]
        text += (f"; the best of another stage, {other.config.label()}, takes "
                 f"{other.step_s:.4g} s ({other.step_s / best.step_s:.2f}x)")  # fmt: skip
    unfit = [p for p in ranked if not p.fits and p.step_s < best.step_s]
    if unfit:
        text += (f"; faster ones do not fit ({unfit[0].config.label()}: "
                 f"{unfit[0].why_not})")  # fmt: skip
    return text


def plan(
    workload: Workload, cluster: Cluster, requested: PlanConfig,
    configs: Sequence[PlanConfig] | None = None,
) -> Plan:  # fmt: skip
    """Predict ``requested`` and every candidate (or ``configs``) and rank them."""
    wanted = predict(workload, cluster, requested)
    pool = list(configs) if configs is not None else candidates(cluster, requested)
    if configs is None and workload.params <= requested.bucket_numel:
        # One bucket holds the whole model: larger buckets change nothing.
        pool = [c for c in pool if c.bucket_numel == requested.bucket_numel]
    ranked = rank(predict(workload, cluster, c) for c in pool)
    return Plan(wanted, ranked, reason(ranked))
