"""zero-plan's cost model: predict a training step's time, memory and traffic per link
for any model on any cluster, and rank the ZeRO configurations.

    cluster.py        Cluster: the hardware (frozen; JSON or flags; units in its docstring)
    presets.py        clusters by name: this-machine, emulated-cluster(-RATE), HARDWARE rows
    calibrate.py      zero-plan --calibrate: this machine's measured rates, stored as JSON
    workload.py       Workload: the model's shape, precision and batch (zero-train's GPT,
                      --params, a Hugging Face config.json)
    configuration.py  PlanConfig: one ZeRO configuration (ZeroConfig's field names)
    traffic.py        a step's link bytes by phase, from zero_core.estimate.link_traffic
    memory.py         bytes per device, host and disk (zero_core.estimate's formulas)
    terms.py          the model's terms, one function each, formula in its docstring
    step_time.py      predict(): the terms combined by the engine's overlap rules
    search.py         candidates(), rank(), plan(): the configurations considered, ranked
    command.py        the zero-plan command line

The API other code builds on (stable):

    from zero_core.plan import Cluster, Workload, PlanConfig, predict, plan, candidates
    cluster = Cluster(name=..., nodes=..., devices_per_node=..., device_memory=...,
                      peak_flops=..., compute_efficiency=..., memory_bandwidth=...,
                      intra_bandwidth=..., intra_latency=..., inter_bandwidth=...,
                      inter_latency=..., host_memory=..., host_bandwidth=...,
                      host_optimizer_rate=..., disk_bandwidth=..., source="...")
    workload = Workload(params=..., layers=..., width=..., heads=..., vocab_size=...,
                        context=..., batch_size=<global sequences per micro-step>,
                        dtype="bf16")
    p = predict(workload, cluster, PlanConfig(stage=3, hpz=16, quantize_weights=True,
                                              quantize_gradients="int4"))
    p.step_s, p.tokens_per_s, p.mfu, p.fits, p.memory.device, p.inter_node_bytes, p.terms
    result = plan(workload, cluster, PlanConfig(stage=3))  # .requested, .ranked, .reason

Hardware presets go in presets.HARDWARE (name -> Cluster), with one fitted
compute_efficiency at most per preset and its source in Cluster.source.
"""

from .cluster import Cluster, parse_quantity
from .configuration import PlanConfig
from .memory import MemoryBytes, memory_bytes
from .presets import HARDWARE, preset, preset_names
from .search import Plan, candidates, plan, rank
from .step_time import Prediction, predict
from .workload import Workload, workload_from_gpt, workload_from_hf_config, workload_from_params

__all__ = [
    "HARDWARE", "Cluster", "MemoryBytes", "Plan", "PlanConfig", "Prediction", "Workload",
    "candidates", "memory_bytes", "parse_quantity", "plan", "predict", "preset",
    "preset_names", "rank", "workload_from_gpt", "workload_from_hf_config",
    "workload_from_params",
]  # fmt: skip
