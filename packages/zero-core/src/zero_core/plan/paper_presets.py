"""The papers' clusters, and today's nodes, as :class:`~zero_core.plan.cluster.Cluster` presets.

Every number has its source beside it. Link rates are the nominal ones the papers or the
vendors state (one direction; NVLink/NVSwitch figures are quoted both ways, so half is
used); no link rate is fitted. The one fitted number per GPU kind is
``compute_efficiency``, shared by every preset with that GPU:

- V100: :data:`V100_EFFICIENCY`, fitted by ``python -m zero_core.plan.papers`` (its
  ``fit_efficiency``) to the papers' absolute throughputs; a test refits it.
- H100 (and, for want of any A100 row, A100): not fitted; :data:`MEASURED_EFFICIENCY`, the
  MFU our engine measured at stage 0 on GPT-2 XL on an H200 (989 TFLOP/s dense bf16, as
  the H100 SXM), docs/benchmarks/gpu.md: 38.4%.

Per-hop latencies are not in the papers; NCCL's own tuning model gives them (NCCL
src/graph/tuning.cc, ``hwLat`` for the ring algorithm and its Simple protocol, which large
buckets use): 3.4 us per step over NVLink and 14 us per step that crosses the network, plus
a base of 8.4 us per collective. :func:`nccl_ring_step_latency` turns them into the one
per-step latency the cost model takes (see its docstring).

ZeRO++'s codecs on a GPU: fused kernels that read fp16 (2 bytes) and write int8/int4 codes
and their scales (about 1 byte), so memory-bound at ``memory_bandwidth / 3`` elements per
second (``codec_rate``; zero-plan's default of 10 bytes an element is the float32 CPU
codec's). Overlap: zero-plan's GPU default (1: NCCL and copy engines run beside compute);
docs/plan-papers.md shows what the papers' numbers say about it.

Sources:

- [ZeRO] arXiv 1910.02054 section 10.1: "400 V100 GPUs (25 DGX-2 nodes) with 800 Gbps
  internode communication bandwidth"; section 10.2: NVSwitch "300GB/sec per link",
  InfiniBand EDR "12.5 GB/sec per link".
- [DGX-2] NVIDIA DGX-2 datasheet: 16 x Tesla V100 32 GB (SXM3), NVSwitch, "2 petaFLOPS"
  tensor (125 TFLOP/s per GPU), 1.5 TB system memory, 2 x Xeon Platinum 8168 (48 cores),
  30 TB NVMe; V100: 900 GB/s HBM2; PCIe 3.0 x16 to the host (15.75 GB/s per direction).
- [ZeRO++] DeepSpeed's ZeRO++ blog (blogs/zeropp) and tutorial: 384 V100 (24 DGX-2 nodes of
  16 x V100-SXM3 32 GB), inter-node "IB: 1" = 1 x 100 Gbps and "IB: 4" = 4 x 100 Gbps per
  node; Figure 8 at 200 and 800 Gbps.
- [Offload-log] DeepSpeed ZeRO-Offload tutorial log (10B, one V100 of a DGX-2):
  optimizer_step 6478.57 and 6217.36 ms for Psi = 10.07e9 float32 elements: 1.59e9
  elements/s for DeepSpeedCPUAdam on the DGX-2's 48 cores.
- [AWS] p3dn.24xlarge: 8 x V100 32 GB with NVLink (300 GB/s per GPU both ways), 100 Gbps
  networking; p4d.24xlarge: 8 x A100 40 GB, NVSwitch 600 GB/s, 400 Gbps EFA.
- [DGX-A100] NVIDIA DGX A100 datasheet: 8 x A100 80 GB, NVSwitch 600 GB/s per GPU both ways,
  8 x 200 Gb/s HDR InfiniBand for compute (1.6 Tb/s per node), 2 TB host memory;
  A100: 312 TFLOP/s dense bf16/fp16, 2039 GB/s HBM2e.
- [H100] NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s,
  NVLink 900 GB/s both ways; PCIe 5.0 x16 (63 GB/s per direction). The node's network
  (100, 200 or 400 Gbit/s per node: a cloud node's, not a DGX H100's 8 x 400) is the
  preset's name.
"""

from __future__ import annotations

from .cluster import GB, GIB, Cluster

# NCCL src/graph/tuning.cc, ring algorithm, Simple protocol: hwLat (s per step) and baseLat.
NVLINK_STEP, NET_STEP, RING_BASE = 3.4e-6, 14e-6, 8.4e-6
CODEC_BYTES = 3  # fp16 read + code and scale written, per element (module docstring)
V100_EFFICIENCY = 0.4155  # fitted: python -m zero_core.plan.papers (module docstring)
MEASURED_EFFICIENCY = 0.384  # docs/benchmarks/gpu.md, ours-0 GPT-2 XL on an H200
GBIT = 1e9 / 8  # bytes/s per Gbit/s


def nccl_ring_step_latency(nodes: int, devices_per_node: int) -> float:
    """One step's latency of a ring over ``nodes`` x ``devices_per_node`` ranks, averaged
    over its steps as NCCL's tuning model charges them (all-gather, reduce-scatter: N - 1
    steps, of which nodes - 1 cross the network)::

        (base + (N - nodes) NVLINK_STEP + (nodes - 1) NET_STEP) / (N - 1)

    zero-plan's latency term (plan/terms.latency_time) charges every step of a group that
    spans nodes at ``inter_latency``; giving it this average makes its (N - 1) steps cost
    what NCCL's model says. (A model change that counts the two kinds of step apart would
    make this unnecessary; issue 51's report asks for it.) The presets hold it at their
    own scale; ``papers`` recomputes it at each row's."""
    n = nodes * devices_per_node
    if nodes < 2 or n < 2:
        return NET_STEP
    return (RING_BASE + (n - nodes) * NVLINK_STEP + (nodes - 1) * NET_STEP) / (n - 1)


def _v100_dgx2(name: str, nodes: int, inter_gbit: float, source: str) -> Cluster:
    """``nodes`` DGX-2s (16 x V100 32 GB on NVSwitch) with ``inter_gbit`` per node."""
    return Cluster(
        name=name,
        nodes=nodes,
        devices_per_node=16,
        device_memory=32 * GIB,  # [DGX-2] V100 32 GB (HBM2, 32 GiB)
        peak_flops=125e12,  # [DGX-2] 2 PFLOP/s / 16 GPUs, fp16 tensor cores
        compute_efficiency=V100_EFFICIENCY,
        memory_bandwidth=900 * GB,  # [DGX-2] V100 HBM2
        intra_bandwidth=150 * GB,  # [ZeRO] NVSwitch 300 GB/s per link, both ways
        intra_latency=NVLINK_STEP,  # NCCL tuning.cc (module docstring)
        inter_bandwidth=inter_gbit * GBIT,  # per node: the source named in `source`
        inter_latency=nccl_ring_step_latency(nodes, 16),  # NCCL tuning.cc, at this scale
        host_memory=1.5e12,  # [DGX-2] 1.5 TB
        host_bandwidth=15.75 * GB,  # [DGX-2] PCIe 3.0 x16, one direction
        host_optimizer_rate=1.59e9 / 16,  # [Offload-log] 48 cores shared by 16 GPUs
        disk_bandwidth=25 * GB,  # not used by any paper row (30 TB NVMe; rate assumed)
        codec_rate=900 * GB / CODEC_BYTES,
        source=source,
    )


ZERO_DGX2 = _v100_dgx2("zero-dgx2", 25, 800, "[ZeRO] 25 DGX-2, 800 Gbps per node")
# ZeRO-Offload's single GPU: one V100 of a DGX-2 with the whole host to itself.
DGX2_ONE_GPU = _v100_dgx2("dgx2-one-gpu", 1, 800, "[Offload-log] one V100 of a DGX-2").with_(
    devices_per_node=1,
    host_optimizer_rate=1.59e9,  # [Offload-log] all 48 cores for one GPU's optimizer
)
ZEROPP_DGX2 = {
    gbit: _v100_dgx2(f"zeropp-dgx2-{gbit}g", 24, gbit, f"[ZeRO++] 24 DGX-2, {gbit} Gbps per node")
    for gbit in (100, 200, 400, 800)
}
MICS_P3DN = Cluster(
    name="mics-p3dn",
    nodes=16,
    devices_per_node=8,
    device_memory=32 * GIB,  # [AWS] V100 32 GB
    peak_flops=125e12,  # V100 SXM2 fp16 tensor (NVIDIA V100 datasheet)
    compute_efficiency=V100_EFFICIENCY,
    memory_bandwidth=900 * GB,
    intra_bandwidth=150 * GB,  # [AWS] NVLink 300 GB/s per GPU both ways
    intra_latency=NVLINK_STEP,
    inter_bandwidth=100 * GBIT,  # [AWS] 100 Gbps per instance
    inter_latency=nccl_ring_step_latency(16, 8),
    host_memory=768 * GIB,  # [AWS] p3dn.24xlarge: 768 GiB
    host_bandwidth=15.75 * GB,  # PCIe 3.0 x16
    host_optimizer_rate=1e8,  # not used by any row (96 vCPUs for 8 GPUs; assumed)
    disk_bandwidth=2 * GB,  # not used by any row (2 x 900 GB NVMe; assumed)
    codec_rate=900 * GB / CODEC_BYTES,
    source="[AWS] p3dn.24xlarge x 16 (MiCS's 100 Gbps setting)",
)
DGX_A100 = Cluster(
    name="dgx-a100",
    nodes=1,
    devices_per_node=8,
    device_memory=80e9,  # [DGX-A100] A100 80 GB
    peak_flops=312e12,  # [DGX-A100] dense bf16/fp16
    compute_efficiency=MEASURED_EFFICIENCY,
    memory_bandwidth=2039 * GB,
    intra_bandwidth=300 * GB,  # [DGX-A100] NVSwitch 600 GB/s both ways
    intra_latency=NVLINK_STEP,
    inter_bandwidth=1600 * GBIT,  # [DGX-A100] 8 x 200 Gb/s HDR
    inter_latency=NET_STEP,
    host_memory=2e12,  # [DGX-A100] 2 TB
    host_bandwidth=31.5 * GB,  # PCIe 4.0 x16, one direction
    host_optimizer_rate=2e8,  # assumed (2 x 64-core EPYC shared by 8 GPUs)
    disk_bandwidth=25 * GB,  # assumed (8 x 3.84 TB NVMe)
    codec_rate=2039 * GB / CODEC_BYTES,
    source="[DGX-A100] datasheet; no paper row runs on it (efficiency not fitted)",
)


def h100_node(gbit: int, nodes: int = 1) -> Cluster:
    """``nodes`` 8 x H100 SXM5 nodes on ``gbit`` Gbit/s per node ([H100])."""
    return Cluster(
        name=f"h100-{gbit}g",
        nodes=nodes,
        devices_per_node=8,
        device_memory=80e9,  # [H100] 80 GB HBM3
        peak_flops=989e12,  # [H100] dense bf16
        compute_efficiency=MEASURED_EFFICIENCY,
        memory_bandwidth=3350 * GB,
        intra_bandwidth=450 * GB,  # [H100] NVLink 900 GB/s both ways
        intra_latency=NVLINK_STEP,
        inter_bandwidth=gbit * GBIT,
        inter_latency=NET_STEP,
        host_memory=2e12,  # assumed (a DGX H100's 2 TB)
        host_bandwidth=63 * GB,  # [H100] PCIe 5.0 x16, one direction
        host_optimizer_rate=2e8,  # assumed
        disk_bandwidth=25 * GB,  # assumed
        codec_rate=3350 * GB / CODEC_BYTES,
        source=f"[H100] 8 x H100 SXM5 per node, {gbit} Gbit/s per node; no paper row",
    )


PAPER_PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in (
        ZERO_DGX2, DGX2_ONE_GPU, *ZEROPP_DGX2.values(), MICS_P3DN, DGX_A100,
        h100_node(100), h100_node(200), h100_node(400),
    )
}  # fmt: skip
# The GPU kind of each preset: presets of one kind share one fitted efficiency.
GPU_KIND = {name: ("v100" if c.peak_flops == 125e12 else name) for name, c in PAPER_PRESETS.items()}
