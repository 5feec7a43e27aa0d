"""One configuration's step: its terms (plan/terms.py) combined by the overlap rules the
engine follows, its memory (plan/memory.py) and whether it fits.

Per step of A micro-steps on one rank (C_f, C_b: forward and backward compute, matmuls +
operators + elementwise, backward twice forward's FLOPs; o: Cluster.overlap)::

    forward    A C_f + exposed(F, A C_f, gathers)                stage 3's gathers F run
               + qwZ coding + disk parameter reads not hidden    ahead along the prefetch
               + launches x launch_overhead
                                                                 record (param_gatherer);
                                                                 none without a prefetch
                                                                 window; the first waits
    backward   A C_b + exposed(R + G + D2H, A C_b, buckets)      reduce-scatters R launch
               + qgZ coding + launches x launch_overhead         as buckets complete
                                                                 (grad_reducer, overlap_comm),
                                                                 the last one after
                                                                 backward; backward gathers
                                                                 G only for units outside
                                                                 the backward head
    step       gradient passes + optimizer (device, or host: S / host rate)
               + disk pipeline (max of read, step and write, plus one tile's fill)
               + H2D parameter copies + the publish all-gather (stages 1-2, after the
               optimizer: not overlapped, docs/step-profile.md) + their launches
               + stage 3's unit bookkeeping + the training loop's step_overhead
    DPU        the host's optimizer, its copies and its disk pipeline H run during the next
               step's forward and backward, as far as the cluster overlaps work at all:
               step = forward + backward + H - o min(forward + backward, H) + the rest

Every count of collectives (the latency terms, the launches, the pieces k below, the fetch
units) is plan/launches.py's, counted on the layout the engine builds.
exposed(x, c, k) = x - o min(x (1 - 1/k), c) (terms.exposed). Tokens per second =
global batch x context x A / step; MFU = 6 Ψ tokens/s / (N peak_flops) (the
recomputation is not useful work).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..estimate.activations import block_saved_bytes
from ..estimate.link_traffic import backward_head_buckets
from ..estimate.offload_traffic import offload_traffic
from . import terms
from .cluster import Cluster
from .configuration import PlanConfig
from .launches import count_launches
from .memory import MemoryBytes, memory_bytes, shard_ranks
from .traffic import Bytes, PhaseBytes, phase_bytes, step_buckets
from .workload import Workload


class Prediction(NamedTuple):
    """A configuration's predicted step on a cluster. Bytes per link are per rank and
    step (zero_comm.stats' ring convention, as zero-estimate prints them); ``terms``
    holds every term in seconds (and the phases' sums) for the reason of a ranking."""

    config: PlanConfig
    fits: bool
    step_s: float
    tokens_per_s: float
    mfu: float
    memory: MemoryBytes
    intra_node_bytes: float
    inter_node_bytes: float
    host_link_bytes: float  # device <-> host, both ways
    disk_link_bytes: float  # host <-> disk, both ways
    terms: dict[str, float]
    why_not: str = ""

    def as_json(self) -> dict[str, Any]:
        """The fields zero-plan --json prints for one configuration."""
        return {
            "config": self.config.as_dict(), "label": self.config.label(), "fits": self.fits,
            "why_not": self.why_not, "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu, "device_bytes": self.memory.device, "host_bytes": self.memory.host,
            "disk_bytes": self.memory.disk, "intra_node_bytes": self.intra_node_bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "device_host_bytes": self.host_link_bytes, "host_disk_bytes": self.disk_link_bytes,
            "memory": self.memory._asdict(), "terms": self.terms,
        }  # fmt: skip


def predict(
    workload: Workload, cluster: Cluster, config: PlanConfig, *, clipping: bool = True
) -> Prediction:
    """The step of ``workload`` under ``config`` on every device of ``cluster`` (data
    parallelism over all of them); ``clipping``: a gradient-norm clip is set (zero-train's
    default --clip 1.0), which reads offloaded gradients once more."""
    n, per_node = cluster.world_size, cluster.devices_per_node
    a = workload.accumulation
    tokens = workload.tokens_per_rank(n)
    recompute = config.checkpoint != "none"
    t: dict[str, float] = {}
    flops = terms.model_flops(workload.params, tokens, workload.layers, workload.width,
                              workload.context, recompute)  # fmt: skip
    saved = block_saved_bytes(workload.shape(n), 1, workload.dtype_bytes)
    micro = (
        terms.compute_time(flops, cluster)
        + terms.operator_time(workload.layers, cluster, recompute)
        + terms.activation_time(saved, workload.layers, cluster)
    )
    # Backward does twice forward's matmuls (and the recomputed forward with checkpointing).
    forward_share = 1 / 3 if not recompute else 1 / 4
    t["compute_forward"] = a * micro * forward_share
    t["compute_backward"] = a * micro * (1 - forward_share)
    phases = phase_bytes(
        workload.params, config, world_size=n, ranks_per_node=per_node,
        dtype_bytes=workload.dtype_bytes, reduce_bytes=workload.grad_bytes, accumulation=a,
    )  # fmt: skip
    group = shard_ranks(config, n)
    spans = n > per_node
    # Launches counted on the engine's own layout (plan/launches.py), per micro-step.
    launches = count_launches(workload, config, group if config.stage >= 1 else n)
    gathers, buckets = max(1, launches.forward_gathers), max(1, launches.reductions)
    link = {name: terms.link_time(getattr(phases, name), cluster, n) for name in phases._fields}
    reduce_hops = 2 if config.stage == 0 else 1
    link["reduction"] += terms.latency_time(
        a * launches.reductions * reduce_hops, group, cluster, spans
    )
    if config.stage == 3:
        link["forward"] += terms.latency_time(
            a * launches.forward_gathers, group, cluster, group > per_node
        )
        gather_group = config.hpz if config.hpz > 1 else group
        link["backward_gathers"] += terms.latency_time(
            a * launches.backward_gathers, gather_group, cluster, gather_group > per_node
        )
    if config.stage >= 1:
        link["after_step"] += terms.latency_time(
            launches.after_step, group, cluster, group > per_node
        )
    t.update({f"link_{k}": v for k, v in link.items()})
    # ZeRO++ coding, per micro-step.
    codec_f = codec_b = 0.0
    if config.quantize_weights:
        codec_f = terms.codec_time(a * workload.params * (1 + 1 / group), cluster)
    if config.quantize_gradients:
        codec_b = terms.codec_time(a * 3 * workload.params, cluster)
    t["codec_forward"], t["codec_backward"] = codec_f, codec_b
    # Offload traffic (per rank, per step).
    shard = workload.params / group if config.stage >= 1 else workload.params
    traffic = _offload_bytes(workload, config, group, clipping)
    to_host = terms.copy_time(traffic["device_to_host"], cluster)
    to_device = terms.copy_time(traffic["host_to_device"], cluster)
    t["copy_to_host"], t["copy_to_device"] = to_host, to_device
    disk_params = terms.disk_time(traffic["disk_params_read"], 0.0, cluster)
    t["disk_parameter_reads"] = disk_params
    o = cluster.overlap
    t["launch_forward"] = terms.launch_time(a * launches.forward_gathers, cluster)
    t["launch_backward"] = terms.launch_time(
        a * (launches.backward_gathers + launches.reductions), cluster
    )
    t["launch_step"] = terms.launch_time(launches.after_step, cluster)
    forward = (
        t["compute_forward"] + codec_f + t["launch_forward"]
        + terms.exposed(link["forward"] + disk_params, t["compute_forward"], gathers, o)
    )  # fmt: skip
    backward_comm = link["reduction"] + link["backward_gathers"] + to_host
    backward = (
        t["compute_backward"] + codec_b + t["launch_backward"]
        + terms.exposed(backward_comm, t["compute_backward"], buckets, o)
    )  # fmt: skip
    # The step.
    t["gradient_passes"] = terms.gradient_time(shard, workload.grad_bytes, cluster)
    on_host = config.offload_optimizer != "none"
    rate = cluster.host_optimizer_rate if on_host else terms.device_optimizer_rate(cluster)
    t["optimizer"] = terms.optimizer_time(shard, rate)
    read, written = traffic["disk_read"], traffic["disk_written"]
    pipeline = 0.0
    if read or written:
        tiles = max(1.0, shard / config.offload_sub_group_numel)
        io = terms.disk_time(read, written, cluster)
        pipeline = max(io, t["optimizer"]) + (io + t["optimizer"]) / tiles - t["optimizer"]
    t["disk_pipeline"] = pipeline
    t["units"] = terms.unit_time(launches.units, a, cluster)
    t["step_overhead"] = terms.step_overhead_time(cluster)
    host_side = t["optimizer"] + pipeline + to_device
    device_side = (
        t["gradient_passes"] + link["after_step"] + t["launch_step"] + t["units"]
        + t["step_overhead"]
    )  # fmt: skip
    if config.delayed_parameter_update:  # the host's step runs beside the next step's
        step_s = forward + backward + host_side - o * min(forward + backward, host_side)
        step_s += device_side
    else:
        step_s = forward + backward + host_side + device_side
    t.update(forward=forward, backward=backward, step=host_side + device_side)
    memory = memory_bytes(workload, config, n)
    why = _why_not(memory, cluster)
    total = phases.total
    global_tokens = workload.batch_size * workload.context * a
    tokens_per_s = global_tokens / step_s
    mfu = 6 * workload.params * tokens_per_s / (n * cluster.peak_flops)
    return Prediction(
        config=config, fits=not why, step_s=step_s, tokens_per_s=tokens_per_s, mfu=mfu,
        memory=memory, intra_node_bytes=total.intra / n, inter_node_bytes=total.inter / n,
        host_link_bytes=traffic["device_to_host"] + traffic["host_to_device"],
        disk_link_bytes=read + written + traffic["disk_params_read"], terms=t, why_not=why,
    )  # fmt: skip


def _head_fraction(params: float, config: PlanConfig) -> float:
    """Share of the units forward keeps gathered for backward (not gathered again)."""
    if not config.keep_backward_head:
        return 0.0
    return min(1.0, (config.backward_head_numel + config.bucket_numel) / params)


def _offload_bytes(
    workload: Workload, config: PlanConfig, group: int, clipping: bool
) -> dict[str, float]:
    """Bytes one rank moves per step between device, host and disk:
    zero_core.estimate.offload_traffic's (its docstring has every term), by link."""
    buckets = step_buckets(workload.params, config, group)
    head = sum(backward_head_buckets(buckets, config.backward_head_numel)) if (
        config.stage == 3 and config.keep_backward_head) else 0  # fmt: skip
    traffic = offload_traffic(
        workload.params, group, config.stage, param_bytes=workload.dtype_bytes,
        grad_bytes=workload.grad_bytes, state_bytes=workload.optimizer_state_bytes,
        offload_optimizer=config.offload_optimizer, offload_params=config.offload_params,
        offload_gradients=config.offload_gradients, accumulation_steps=workload.accumulation,
        backward_head_numel=head, clipping=clipping,
    )  # fmt: skip
    # Parameter reads from disk belong to the gathers in forward and backward; the rest
    # of the disk traffic to the step's pipeline.
    gathered = traffic.disk_to_host.parameters if config.offload_params == "disk" else 0.0
    return {
        "device_to_host": traffic.device_to_host.total,
        "host_to_device": traffic.host_to_device.total,
        "disk_read": traffic.disk_to_host.total - gathered,
        "disk_written": traffic.host_to_disk.total,
        "disk_params_read": gathered,
    }


def _why_not(memory: MemoryBytes, cluster: Cluster) -> str:
    """Why the configuration does not fit ("" if it does)."""
    if memory.device > cluster.device_memory:
        return (f"device needs {memory.device / 1e9:.3g} GB of "
                f"{cluster.device_memory / 1e9:.3g} GB")  # fmt: skip
    host = memory.host * cluster.devices_per_node
    if host > cluster.host_memory:
        return f"host needs {host / 1e9:.3g} GB per node of {cluster.host_memory / 1e9:.3g} GB"
    disk = memory.disk * cluster.devices_per_node
    if disk > cluster.disk_bytes:
        return f"disk needs {disk / 1e9:.3g} GB per node of {cluster.disk_bytes / 1e9:.3g} GB"
    return ""


__all__ = ["Bytes", "PhaseBytes", "Prediction", "predict"]
