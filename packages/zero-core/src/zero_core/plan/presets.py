"""Clusters by name. Every number has its source beside it.

    this-machine          this computer, from its stored calibration (plan/calibrate.py):
                          one node of ``ranks`` CPU ranks, gloo over loopback
    emulated-cluster      nox -s cluster's 2 hosts x 2 ranks on this machine (tools/cluster,
    emulated-cluster-RATE docs/benchmarks/cluster.md), RATE 100mbit, 1gbit (the default) or
                          40gbit: the link at the TCP rate measured there, the 4 ranks on
                          this machine's cores

Hardware presets (DGX-2, DGX-A100, H100 nodes; the papers' clusters) are rows of
:data:`HARDWARE`: fixed :class:`Cluster` values, one fitted ``compute_efficiency`` each at
most, with its source.
"""

from __future__ import annotations

import os
from typing import Any

from ..estimate.activations import TransformerShape, block_saved_bytes
from .calibrate import load_calibration, matmul_rate
from .cluster import Cluster
from .paper_presets import PAPER_PRESETS
from .terms import ACTIVATION_PASSES

# The swap pipeline's measured bandwidth on this machine (docs/benchmarks/swap.md: 2110 MB/s
# write, 2421 MB/s read, 4 threads): their mean.
THIS_MACHINE_DISK_BANDWIDTH = 2.27e9
# docs/benchmarks/cluster.md (de4a966): TCP h0 -> h1 measured on each tbf rate, Mbit/s.
EMULATED_LINK_MBIT = {"100mbit": 95.3, "1gbit": 647.9, "40gbit": 4123.2}
EMULATED_NODES, EMULATED_RANKS_PER_NODE = 2, 2

# The papers' clusters and today's GPU nodes (plan/paper_presets.py: every number's source,
# the V100's fitted efficiency).
HARDWARE: dict[str, Cluster] = dict(PAPER_PRESETS)


def _memory_total() -> float:
    """Bytes of this machine's memory (MemTotal), or 0 where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def this_machine(
    calibration: dict[str, Any], ranks: int = 2, width: int = 128, *, nodes: int = 1
) -> Cluster:
    """This machine as ``nodes`` x ``ranks`` CPU ranks (zero-train's --nproc), from its
    calibration: the matmul rate at the model's ``width``, shared where ranks outnumber
    the cores (the calibration ran ``calibration["ranks"]`` processes at once, 1 thread
    each); gloo's loopback bandwidth for every link, and as latency the larger of its
    back-to-back latency and its cost between stretches of compute (sync_s). Overlap: none while
    every rank has a core (gloo's threads and the ranks share the cores, none is idle);
    with more ranks than cores, a rank that waits on a link leaves its share of the cores
    to the others, so 1 - cores / ranks of its waiting hides behind their compute. The
    engine's fixed costs (per launch, per fetch unit, per step) and op_overhead take
    longer by the same share of a core. Device memory = host memory = MemTotal / ranks."""
    cores = int(calibration.get("cpu_count") or os.cpu_count() or 1)
    measured_with = int(calibration.get("ranks", 1))
    share = min(1.0, cores / (ranks * nodes)) / min(1.0, cores / measured_with)
    overlap = 1.0 - min(1.0, cores / (ranks * nodes))
    rate = matmul_rate(calibration, width) * share
    gloo = calibration.get("gloo") or {"latency_s": 1e-4, "bandwidth": 1e9}
    # A collective inside a step costs what it costs between stretches of compute.
    latency = max(float(gloo["latency_s"]), float(gloo.get("sync_s", 0.0)))
    memory = _memory_total() or 16e9
    activation = 0.0
    residuals = calibration.get("block_residual_s") or {}
    if residuals:  # a calibrated block's elementwise work, as a rate over its saved bytes
        rates = {
            w: ACTIVATION_PASSES
            * block_saved_bytes(TransformerShape(1, int(w), max(1, int(w) // 32), 1, 1024))
            / max(float(r), 1e-9)
            for w, r in residuals.items()
        }
        activation = matmul_rate({"matmul_flops": rates}, width) * share
    bandwidth = float(calibration["memory_bandwidth"]) * share
    engine = calibration.get("engine") or {}  # fixed costs: none in older calibrations
    return Cluster(
        name="this-machine", nodes=nodes, devices_per_node=ranks,
        device_memory=memory / (ranks * nodes), peak_flops=rate, compute_efficiency=1.0,
        memory_bandwidth=bandwidth, intra_bandwidth=float(gloo["bandwidth"]),
        intra_latency=latency, inter_bandwidth=float(gloo["bandwidth"]),
        inter_latency=latency, host_memory=memory / nodes,
        host_bandwidth=bandwidth, host_optimizer_rate=float(calibration["optimizer_rate"]) * share,
        optimizer_rate=float(calibration["optimizer_rate"]) * share,
        activation_bandwidth=activation,
        disk_bandwidth=THIS_MACHINE_DISK_BANDWIDTH,
        op_overhead=float(calibration["op_overhead"]) / share, overlap=overlap,
        launch_overhead=float(engine.get("launch_overhead", 0.0)) / share,
        unit_overhead=float(engine.get("unit_overhead", 0.0)) / share,
        step_overhead=float(engine.get("step_overhead", 0.0)) / share,
        source=f"calibrated {calibration.get('measured_at', '?')} (zero-plan --calibrate; "
        f"load average {calibration.get('load_average', '?')}); disk: docs/benchmarks/swap.md",
    )  # fmt: skip


def emulated_cluster(calibration: dict[str, Any], rate: str = "1gbit", width: int = 128) -> Cluster:
    """nox -s cluster's emulated cluster at link ``rate`` (module docstring): this machine
    split into 2 nodes of 2 ranks, the inter-node link at the TCP rate measured at that
    tbf rate, latency as loopback's (no delay configured)."""
    if rate not in EMULATED_LINK_MBIT:
        raise ValueError(f"emulated-cluster rate {rate!r}: one of {sorted(EMULATED_LINK_MBIT)}")
    base = this_machine(calibration, EMULATED_RANKS_PER_NODE, width, nodes=EMULATED_NODES)
    return base.with_(
        name=f"emulated-cluster-{rate}", inter_bandwidth=EMULATED_LINK_MBIT[rate] * 1e6 / 8,
        source=base.source + f"; link: docs/benchmarks/cluster.md's measured TCP rate at {rate}",
    )  # fmt: skip


def preset_names() -> list[str]:
    """Every preset name zero-plan --cluster takes."""
    emulated = [f"emulated-cluster-{r}" for r in EMULATED_LINK_MBIT]
    return ["this-machine", "emulated-cluster", *emulated, *HARDWARE]


def needs_calibration(name: str) -> bool:
    return name == "this-machine" or name.startswith("emulated-cluster")


def preset(
    name: str, calibration: dict[str, Any] | None = None, *, ranks: int = 2, width: int = 128
) -> Cluster:
    """The cluster named ``name`` (preset_names()); this machine's presets read
    ``calibration`` (None: the stored one, which must exist)."""
    if name in HARDWARE:
        return HARDWARE[name]
    if not needs_calibration(name):
        raise ValueError(f"no cluster preset {name!r}; the presets are {preset_names()}")
    calibration = calibration or load_calibration()
    if calibration is None:
        raise ValueError(f"preset {name!r} needs this machine's calibration: run zero-plan "
                         "--calibrate first")  # fmt: skip
    if name == "this-machine":
        return this_machine(calibration, ranks, width)
    rate = name.removeprefix("emulated-cluster").removeprefix("-") or "1gbit"
    return emulated_cluster(calibration, rate, width)
