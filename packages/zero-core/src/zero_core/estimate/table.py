"""zero-estimate's printed table: one row per stage (device, host, disk bytes per rank,
the device's working memory, activations and link bytes where asked), then the bytes
one step moves over the offload links (zero_core.estimate.command builds the rows)."""

from __future__ import annotations

import argparse
from typing import Any

from .activations import ActivationBytes

STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
LINKS = {
    "device_to_host": "device->host",
    "host_to_device": "host->device",
    "disk_to_host": "disk->host",
    "host_to_disk": "host->disk",
}
PARTS = ("gradients", "parameters", "optimizer_states")


def _gb(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value / 1e9:.{digits}f} GB"


def print_table(
    args: argparse.Namespace, k: float, rows: dict[int, dict[str, Any]],
    activations: ActivationBytes | None,
) -> None:  # fmt: skip
    print(
        f"model states per rank, Ψ={args.params:.4g}, N={args.world_size}, "
        f"{args.dtype} parameters and "
        + (f"{args.reduce_dtype} " if args.reduce_dtype else "")
        + f"gradients, K={k:g}"
        + ("; stage 3 steps the optimizer in backward" if args.optimizer_in_backward else "")
    )
    asked = args.offload_optimizer != "none" or args.offload_params != "none"
    if asked:
        gradients = "device" if args.no_offload_gradients else f"{args.offload_optimizer} (2-3)"
        print(
            f"tiers: masters and optimizer states {args.offload_optimizer} (fraction "
            f"{args.offload_fraction:g}, stages 1-3), gradients {gradients}, parameters "
            f"{args.offload_params} (stage 3)"
        )
    digits = 1 if activations is None and not asked else 3
    extra = activations.peak if activations is not None else 0.0
    staging = "disk" in (args.offload_optimizer, args.offload_params)
    header = f"  {'stage':17s} {'device':>13s} {'(+ working)':>13s} {'host':>13s} {'disk':>13s}"
    print(header + (f" {'(host: staging)':>16s} {'(+ read ahead)':>15s}" if staging else ""))
    for stage, row in rows.items():
        line = f"  stage {stage} {STAGE_NAMES[stage]:9s}"
        line += f" {_gb(row['device'], digits):>13s} {_gb(row['working'], 3):>13s}"
        line += "".join(f" {_gb(row[t], digits):>13s}" for t in ("host", "disk"))
        if staging:
            line += f" {_gb(row['staging'], digits):>16s} {_gb(row['read_ahead'], digits):>15s}"
        if activations is not None:
            line += (
                f"  + activations {extra / 1e9:.3f} GB = "
                f"{(row['device_peak'] + extra) / 1e9:.3f} GB on the device"
            )
        if "inter_node_bytes" in row:
            line += (
                f"  | per step: {row['intra_node_bytes'] / 1e9:.3f} GB intra-node, "
                f"{row['inter_node_bytes'] / 1e9:.3f} GB inter-node"
            )
        print(line)
    print("working: the device's bounded buffers (gradient buckets in flight, stage 3's "
          "gathered units; zero_core.estimate.working_set)")  # fmt: skip
    if asked:
        _print_links(rows)
    head = rows[3].get("backward_head_numel", 0)
    if head:
        print(f"stage 3's link bytes: backward does not gather again the {head:,} elements of "
              "the buckets forward keeps for it (--backward-head-numel; --no-backward-head "
              "for the paper's 3Ψ(N-1)/N)")  # fmt: skip
    if activations is not None:
        print(f"activations ({args.checkpoint} checkpointing, TP {args.tp}): "
              f"{activations.kept / 1e9:.3f} GB kept through forward, "
              f"{activations.peak / 1e9:.3f} GB at the step's peak")  # fmt: skip


def _print_links(rows: dict[int, dict[str, Any]]) -> None:
    """Bytes per rank per step over the offload links, for the stages that offload."""
    print("offload links, per rank per step (gradients + parameters + masters and states):")
    for stage, row in rows.items():
        links = row["links"]
        if not any(link["total"] for link in links.values()):
            continue
        parts = []
        for key, name in LINKS.items():
            link = links[key]
            split = "+".join(f"{link[what] / 1e9:.3f}" for what in PARTS)
            parts.append(f"{name} {link['total'] / 1e9:.3f} GB ({split})")
        print(f"  stage {stage} {STAGE_NAMES[stage]:9s} " + ", ".join(parts))
