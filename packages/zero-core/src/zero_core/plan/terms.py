"""The cost model's terms, one function each, with its formula. Times in seconds per step
on one rank; Ψ parameters, N data-parallel ranks, A micro-steps per step, n tokens per
rank per micro-step, L layers, C width, T context.

The overlap rules that combine them are plan/step_time.py's; the bytes come from
zero_core.estimate (link_traffic via plan/traffic.py, model_states, activations).
"""

from __future__ import annotations

import math

from .cluster import Cluster
from .traffic import Bytes

# Operators one pre-LayerNorm GPT block runs in forward and backward together (autograd's
# nodes and the forward's ops of zero_models.gpt.Block, counted with torch.profiler on the
# small GPT: 21 forward, 39 backward), and the embedding, final LayerNorm, head and loss.
OPS_PER_BLOCK = 60
OPS_OUTSIDE_BLOCKS = 30
# Stage 3: the operators each fetch unit's gather and release cost (hooks, views, storage
# resizes) per pass, where a cluster has no calibrated unit_overhead.
OPS_PER_UNIT_PASS = 12
# Elementwise passes over a block's saved activations: written in forward, read in
# backward, their gradients written and read.
ACTIVATION_PASSES = 4
# Bytes AdamW moves per float32 element of the master: read master, gradient, exp_avg,
# exp_avg_sq; write master, exp_avg, exp_avg_sq (docs/benchmarks/cpu-optimizer.md).
OPTIMIZER_BYTES_PER_ELEMENT = 28
# Passes over the gradient shard outside the optimizer: the non-finite check, the norm
# for clipping, the cast to the float32 master's dtype.
GRADIENT_PASSES = 3
# Bytes a block quantizer moves per element it codes or decodes: read 4 (float32 input;
# twice: absmax, then scale and round) and write 1 (codes) or the reverse.
CODEC_BYTES_PER_ELEMENT = 10


def model_flops(params: float, tokens: float, layers: int, width: int, context: int,
                recompute: bool = False) -> float:  # fmt: skip
    """FLOPs of forward and backward of a dense transformer over ``tokens`` tokens:

    6 Ψ n + 12 L T C n                  (Kaplan et al. 2020; attention's scores)
    + 2 Ψ n + 4 L T C n                 with activation checkpointing (forward again)
    """
    flops = 6.0 * params * tokens + 12.0 * layers * context * width * tokens
    if recompute:
        flops += 2.0 * params * tokens + 4.0 * layers * context * width * tokens
    return flops


def compute_time(flops: float, cluster: Cluster) -> float:
    """FLOPs at the achieved rate: flops / (peak_flops x compute_efficiency)."""
    return flops / cluster.achieved_flops


def operator_time(layers: int, cluster: Cluster, recompute: bool = False) -> float:
    """Fixed cost of the operators of forward and backward:
    (OPS_PER_BLOCK L (x 4/3 recomputing: forward again) + OPS_OUTSIDE_BLOCKS) op_overhead."""
    blocks = OPS_PER_BLOCK * layers * (4 / 3 if recompute else 1)
    return (blocks + OPS_OUTSIDE_BLOCKS) * cluster.op_overhead


def activation_time(block_saved_bytes: float, layers: int, cluster: Cluster) -> float:
    """Elementwise work (LayerNorm, GELU, softmax, residuals) as memory traffic:
    ACTIVATION_PASSES x L x the block's saved bytes / activation_bandwidth (calibrated:
    what a real block's work beyond its matmuls takes; else memory_bandwidth)."""
    rate = cluster.activation_bandwidth or cluster.memory_bandwidth
    return ACTIVATION_PASSES * layers * block_saved_bytes / rate


def unit_time(units: int, accumulation: int, cluster: Cluster) -> float:
    """Stage 3's bookkeeping of its fetch units (hooks, state checks, views, storage
    resizes) beyond their collectives' launches: units x 2 passes x A x unit_overhead
    (calibrated; where a cluster gives none, OPS_PER_UNIT_PASS x op_overhead per pass).
    ``units``: plan/launches.py's count, from fetch_units' rule."""
    per_pass = cluster.unit_overhead or OPS_PER_UNIT_PASS * cluster.op_overhead
    return units * 2 * accumulation * per_pass


def launch_time(launches: float, cluster: Cluster) -> float:
    """The engine's own cost per collective it launches, beyond the link's latency
    (latency_time): staging the bucket, the hooks and bookkeeping, handing it to the
    backend and waiting on its handle: launches x launch_overhead. It runs on the rank's
    own thread, so nothing hides it. ``launches``: plan/launches.py's count."""
    return launches * cluster.launch_overhead


def step_overhead_time(cluster: Cluster) -> float:
    """What a training loop's step costs whatever the model: step_overhead (calibrated:
    a one-layer model's step through the engine as zero-train runs it, with its memory
    tracker's phases, the loss's item() and the all-reduce that agrees on it, less that
    step's own launches). Once per step."""
    return cluster.step_overhead


def link_time(bytes_: Bytes, cluster: Cluster, ranks: int) -> float:
    """Bandwidth time of ``bytes_`` (summed over the ``ranks`` ranks, zero_comm.stats'
    ring convention) on the links they cross, which run at once (a ring moves a chunk
    on every link at every hop, so the slowest link class sets the pace):

        max(intra / ranks / intra_bandwidth, inter / nodes / inter_bandwidth)
    """
    nodes = max(1, math.ceil(ranks / cluster.devices_per_node))
    intra = bytes_.intra / ranks / cluster.intra_bandwidth
    inter = bytes_.inter / nodes / cluster.inter_bandwidth if bytes_.inter else 0.0
    return max(intra, inter)


def latency_time(collectives: float, group: int, cluster: Cluster, spans_nodes: bool) -> float:
    """Start-up time of ``collectives`` ring collectives over ``group`` ranks:
    collectives x (group - 1) hops x (inter_latency if the group spans nodes, else
    intra_latency)."""
    if group < 2:
        return 0.0
    hop = cluster.inter_latency if spans_nodes else cluster.intra_latency
    return collectives * (group - 1) * hop


def codec_time(elements: float, cluster: Cluster) -> float:
    """qwZ/qgZ coding: elements coded or decoded / codec_rate, or where the cluster gives
    none, x CODEC_BYTES_PER_ELEMENT / memory_bandwidth. Per micro-step each rank codes its
    shard and decodes every part of a gather (qwZ: Ψ/S + Ψ), and for qgZ codes its whole
    gradient, decodes N parts, codes its node's partial and decodes M (about 3 Ψ)."""
    if cluster.codec_rate > 0:
        return elements / cluster.codec_rate
    return elements * CODEC_BYTES_PER_ELEMENT / cluster.memory_bandwidth


def optimizer_time(shard_numel: float, rate: float) -> float:
    """The optimizer over the rank's float32 master shard S: S / rate, where the rate is
    calibrated (this machine: torch AdamW), or memory_bandwidth / OPTIMIZER_BYTES_PER_ELEMENT."""
    return shard_numel / rate


def device_optimizer_rate(cluster: Cluster) -> float:
    """Elements/s the device's optimizer steps: Cluster.optimizer_rate where given
    (calibrated), else memory_bandwidth / 28 (AdamW's bytes per element)."""
    if cluster.optimizer_rate > 0:
        return cluster.optimizer_rate
    return cluster.memory_bandwidth / OPTIMIZER_BYTES_PER_ELEMENT


def gradient_time(shard_numel: float, grad_bytes: float, cluster: Cluster) -> float:
    """The engine's passes over the gradient shard before the optimizer (non-finite check,
    clipping's norm, the float32 cast): GRADIENT_PASSES x S x g / memory_bandwidth."""
    return GRADIENT_PASSES * shard_numel * grad_bytes / cluster.memory_bandwidth


def copy_time(bytes_: float, cluster: Cluster) -> float:
    """Device <-> host copies of one rank: bytes / host_bandwidth (each direction has its
    own lanes; callers add the two directions only where they run in turn)."""
    return bytes_ / cluster.host_bandwidth


def disk_time(read: float, written: float, cluster: Cluster) -> float:
    """Swap traffic of one rank: the node's disk is shared by its devices, and reads and
    writes share it: (read + written) x devices_per_node / disk_bandwidth."""
    return (read + written) * cluster.devices_per_node / cluster.disk_bandwidth


def exposed(comm: float, compute: float, pieces: float, overlap: float) -> float:
    """Communication left on the critical path when ``comm`` is issued in ``pieces``
    during ``compute`` (buckets launched as backward completes them; gathers prefetched
    along forward's record): all but the last piece can hide, behind at most the compute,
    as far as the cluster overlaps at all:

        comm - overlap x min(comm (1 - 1/pieces), compute)
    """
    if comm <= 0:
        return 0.0
    hideable = comm * (1 - 1 / max(pieces, 1.0))
    return comm - overlap * min(hideable, compute)
