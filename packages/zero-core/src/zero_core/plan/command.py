"""``zero-plan``: which ZeRO configuration for this model on this cluster, and how fast.

    zero-plan                                   # zero-train's default run, on this machine
    zero-plan --stage 3 --offload-optimizer disk --offload-params disk --steps 50
    zero-plan --model gpt2 --batch-size 32 --cluster emulated-cluster-100mbit
    zero-plan --params 7.5e9 --layers 32 --width 4096 --cluster my-cluster.json --json
    zero-plan --hf-config path/to/config.json --cluster dgx-a100 --nodes 16
    zero-plan --calibrate                       # measure this machine, store, plan
    zero-plan --memory-only ...                 # zero-estimate's table for the same run

The model comes from zero-train's options (the same flags; those that do not change a
step, like --steps and --out, are accepted and ignored), or from --params with --layers
and --width, or from a Hugging Face config.json. The cluster from --cluster (a preset name
or a JSON file of zero_core.plan.Cluster's fields) and flags that override its fields;
without one, this machine (calibrated first if no calibration is stored).

For the requested configuration and every one considered (zero_core.plan.search), it
prints: fits?, memory per device, host and disk, bytes per rank per link per step,
predicted step time, tokens/s and MFU, ranked, and why the winner won. --json prints
{"requested": {...}, "ranked": [...], "reason": "...", "cluster": {...}, "workload": {...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..command_line import CommandLineParser
from .calibrate import calibrate, calibration_path, load_calibration
from .cluster import Cluster, parse_quantity
from .configuration import PlanConfig
from .presets import needs_calibration, preset, preset_names
from .search import Plan, plan
from .step_time import Prediction
from .workload import (
    DTYPE_BYTES,
    GPT_PRESETS,
    Workload,
    workload_from_gpt,
    workload_from_hf_config,
    workload_from_params,
)

# zero-train's options that do not change a step: accepted, ignored (name -> takes a value).
IGNORED = {
    "--steps": True, "--out": True, "--overwrite": False, "--lr": True, "--warmup": True,
    "--clip": True, "--seed": True, "--data": True, "--sample-tokens": True,
    "--save-every": True, "--keep-checkpoints": True, "--final-save": False,
    "--no-final-save": False, "--resume": True, "--preempt-signals": True, "--threads": True,
    "--comm-timeout": True, "--heartbeat-timeout": True, "--stop-after": True,
    "--tensorboard": None, "--offload-dir": True, "--backend": True,
    "--offload-checkpoints": False,
}  # fmt: skip
# zero-train's options for ranks that are not alike (mixed hardware): they change a step,
# and the plan's Cluster has one device kind, so planning without them would answer for
# another run. Known to the parser (a zero-train command line parses) and refused when given.
UNEVEN_RANKS = (
    "--micro-batches-per-rank", "--shard-weights", "--virtual-ranks",
    "--emulate-micro-batch-seconds",
)  # fmt: skip
CLUSTER_FLAGS = {
    "nodes": "nodes", "devices_per_node": "devices per node", "device_memory": "bytes per device",
    "peak_flops": "peak FLOP/s per device", "compute_efficiency": "achieved / peak",
    "memory_bandwidth": "device memory bytes/s", "intra_bandwidth": "intra-node bytes/s",
    "intra_latency": "intra-node latency, s", "inter_bandwidth": "inter-node bytes/s per node",
    "inter_latency": "inter-node latency, s", "host_memory": "host bytes per node",
    "host_bandwidth": "device<->host bytes/s", "disk_bandwidth": "disk bytes/s per node",
    "disk_bytes": "disk bytes per node", "overlap": "share of communication that can overlap",
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="zero-plan", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", type=Path, help="zero-train's JSON file of option values "
                   "(flags override it)")  # fmt: skip
    p.add_argument("--deepspeed", type=Path, help=argparse.SUPPRESS)
    model = p.add_argument_group("model (zero-train's options)")
    model.add_argument("--model", default="small", choices=sorted(GPT_PRESETS))
    for name in ("layers", "heads", "width", "context"):
        model.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    model.add_argument("--vocab-size", type=int, help="with --params: vocabulary (default 50257)")
    model.add_argument("--params", type=float, help="Ψ: a dense transformer of this many "
                       "parameters (with --layers and --width)")  # fmt: skip
    model.add_argument("--hf-config", type=Path, help="a Hugging Face config.json")
    model.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_BYTES))
    model.add_argument("--reduce-dtype", choices=sorted(DTYPE_BYTES))
    model.add_argument("--batch-size", type=int, default=16,
                       help="sequences per micro-step over all ranks (zero-train's)")  # fmt: skip
    model.add_argument("--grad-accum", type=int, default=1)
    model.add_argument("--nproc", type=int, default=2,
                       help="this machine's ranks (zero-train's; without --cluster)")  # fmt: skip
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1 only)")
    config = p.add_argument_group("the requested ZeRO configuration (zero-train's options)")
    config.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    config.add_argument("--checkpoint", default="none", choices=("none", "full", "partitioned"))
    config.add_argument("--offload-optimizer", default="none", choices=("none", "cpu", "disk"))
    config.add_argument("--offload-params", default="none", choices=("none", "cpu", "disk"))
    config.add_argument("--no-offload-gradients", action="store_true")
    config.add_argument("--delayed-parameter-update", action="store_true")
    config.add_argument("--shard-group", type=int)
    config.add_argument("--hpz", type=int, default=1)
    config.add_argument("--quantize-weights", action="store_true")
    config.add_argument("--quantize-gradients", choices=("int4", "int8"))
    config.add_argument("--optimizer-in-backward", action="store_true",
                        help="accepted; planned as the ordinary step")  # fmt: skip
    config.add_argument("--bucket-numel", type=int, default=2**22)
    config.add_argument("--prefetch-numel", type=int, default=PlanConfig().prefetch_numel)
    cluster = p.add_argument_group("the cluster (a preset or JSON file, then flags over it)")
    cluster.add_argument("--cluster", help=f"preset ({', '.join(preset_names())}) or a JSON file")
    for field, what in CLUSTER_FLAGS.items():
        cluster.add_argument(f"--{field.replace('_', '-')}", dest=f"cluster_{field}",
                             metavar="X", help=what)  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument(
        "--calibrate",
        action="store_true",
        help=f"measure this machine first and store it ({calibration_path()})",
    )
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--top", type=int, default=12, help="ranked rows to print (default 12)")
    out.add_argument("--memory-only", action="store_true",
                     help="zero-estimate's table for this model and cluster")  # fmt: skip
    out.add_argument("--list-presets", action="store_true")
    for flag, takes in IGNORED.items():
        kwargs = {"nargs": "?"} if takes is None else ({} if takes else {"action": "store_true"})
        p.add_argument(flag, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]
    for flag in UNEVEN_RANKS:
        p.add_argument(flag, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.config is not None:  # zero-train's rule: the file's values, then the flags
        args = parser.parse_args([*config_flags(parser, args.config), *argv])
    if args.deepspeed is not None:
        parser.error("--deepspeed: zero-plan does not read DeepSpeed configs; give the run's "
                     "--stage, --dtype, --batch-size and offload as flags")  # fmt: skip
    if args.list_presets:
        print("\n".join(preset_names()))
        return
    given = [f for f in UNEVEN_RANKS if getattr(args, f[2:].replace("-", "_")) is not None]
    if given:
        parser.error(f"{', '.join(given)}: zero-plan plans ranks that are alike; zero-train's "
                     "--micro-batches-per-rank auto profiles mixed ranks and prints its "
                     "predicted step (docs/mixed-hardware.md); drop these options to plan "
                     "the even run")  # fmt: skip
    if args.tp != 1:
        parser.error(f"--tp {args.tp}: zero-plan models data parallelism only; give --tp 1")
    try:
        workload = _workload(args)
        calibration = load_calibration()
        if args.calibrate:
            print(f"zero-plan: calibrating this machine ({args.nproc} processes)...",
                  file=sys.stderr, flush=True)  # fmt: skip
            calibration = calibrate(ranks=max(2, args.nproc))
        cluster = _cluster(args, workload, calibration)
        requested = _requested(args, cluster)
    except ValueError as exc:
        parser.error(str(exc))
    if args.memory_only:
        _memory_only(args, workload, cluster, requested)
        return
    try:
        workload.tokens_per_rank(cluster.world_size)
    except ValueError as exc:
        parser.error(f"--batch-size: {exc}")
    result = plan(workload, cluster, requested)
    if args.json:
        print(json.dumps(_json(result, workload, cluster)))
    else:
        _print(result, workload, cluster, args.top)


def config_flags(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """zero-train's --config JSON object as flags ({"batch_size": 4} -> ["--batch-size",
    "4"]; true/false for switches); unknown keys stop with usage."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--config {path}: cannot read a JSON object from it ({exc})")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: must hold a JSON object of option values")
    options = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(str(k) for k in set(values) - set(options) or ())
    if unknown or "config" in values:
        parser.error(f"--config {path}: unknown keys {unknown or ['config']}")
    flags: list[str] = []
    for key, value in values.items():
        option = options[key]
        if option.nargs == 0:
            if value is True:
                flags.append(option.option_strings[0])
            continue
        flags += [option.option_strings[0], str(value)]
    return flags


def _workload(args: argparse.Namespace) -> Workload:
    common = dict(batch_size=args.batch_size, accumulation=args.grad_accum, dtype=args.dtype,
                  reduce_dtype=args.reduce_dtype)  # fmt: skip
    if args.hf_config is not None:
        return workload_from_hf_config(args.hf_config, context=args.context, **common)
    if args.params is not None:
        if args.layers is None or args.width is None:
            raise ValueError("--params needs --layers and --width")
        return workload_from_params(
            args.params, args.layers, args.width, heads=args.heads,
            vocab_size=args.vocab_size or 50257, context=args.context or 1024, **common,
        )  # fmt: skip
    return workload_from_gpt(args.model, layers=args.layers, heads=args.heads, width=args.width,
                             context=args.context, **common)  # fmt: skip


def _cluster(
    args: argparse.Namespace, workload: Workload, calibration: dict[str, Any] | None
) -> Cluster:
    name = args.cluster or "this-machine"
    if needs_calibration(name) and calibration is None:
        print("zero-plan: no calibration of this machine is stored; measuring it now "
              f"(stored at {calibration_path()})", file=sys.stderr, flush=True)  # fmt: skip
        calibration = calibrate(ranks=max(2, args.nproc))
    if name.endswith(".json") or Path(name).is_file():
        cluster = Cluster.load(Path(name))
    else:
        cluster = preset(name, calibration, ranks=args.nproc, width=workload.width)
    overrides = {
        field: getattr(args, f"cluster_{field}") for field in CLUSTER_FLAGS
        if getattr(args, f"cluster_{field}") is not None
    }  # fmt: skip
    if overrides:
        cluster = Cluster.from_json(
            {k: parse_quantity(v, f"--{k.replace('_', '-')}") for k, v in overrides.items()},
            base=cluster,
        )  # fmt: skip
    return cluster


def _requested(args: argparse.Namespace, cluster: Cluster) -> PlanConfig:
    return PlanConfig(
        stage=args.stage, offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params, offload_gradients=not args.no_offload_gradients,
        delayed_parameter_update=args.delayed_parameter_update,
        shard_group=args.shard_group if args.shard_group not in (None, -1) else None,
        hpz=args.hpz, quantize_weights=args.quantize_weights,
        quantize_gradients=args.quantize_gradients, checkpoint=args.checkpoint,
        bucket_numel=args.bucket_numel, prefetch_numel=args.prefetch_numel,
    )  # fmt: skip


def _memory_only(
    args: argparse.Namespace, workload: Workload, cluster: Cluster, config: PlanConfig
) -> None:
    """zero-estimate's output for this workload, cluster and configuration (its command,
    called with the equivalent options, printed first on stderr)."""
    from ..estimate.command import main as estimate_main

    n = cluster.world_size
    argv = [
        "--params", repr(workload.params), "--world-size", str(n), "--dtype", workload.dtype,
        "--optimizer", "adamw", "--layers", str(workload.layers), "--width", str(workload.width),
        "--heads", str(workload.heads), "--vocab-size", str(workload.vocab_size),
        "--tokens", str(workload.tokens_per_rank(n)),
        "--checkpoint", "none" if config.checkpoint == "none" else "full",
        "--offload-optimizer", config.offload_optimizer, "--offload-params", config.offload_params,
        "--bucket-numel", str(config.bucket_numel), "--prefetch-numel", str(config.prefetch_numel),
        "--ranks-per-node", str(cluster.devices_per_node), "--hpz", str(config.hpz),
        "--accumulation", str(workload.accumulation),
    ]  # fmt: skip
    if workload.reduce_dtype:
        argv += ["--reduce-dtype", workload.reduce_dtype]
    if config.shard_group:
        argv += ["--shard-group", str(config.shard_group)]
    if config.quantize_weights:
        argv.append("--quantize-weights")
    if config.quantize_gradients:
        argv += ["--quantize-gradients", config.quantize_gradients]
    if args.json:
        argv.append("--json")
    print("zero-plan: zero-estimate " + " ".join(argv), file=sys.stderr, flush=True)
    estimate_main(argv)


def _json(result: Plan, workload: Workload, cluster: Cluster) -> dict[str, object]:
    return {
        "requested": result.requested.as_json(),
        "ranked": [p.as_json() for p in result.ranked],
        "reason": result.reason,
        "cluster": cluster.to_json(),
        "workload": {k: getattr(workload, k) for k in workload.__dataclass_fields__},
    }


def _gb(value: float) -> str:
    return f"{value / 1e9:.3g}"


def _row(p: Prediction) -> str:
    return (
        f"{'yes' if p.fits else 'no ':3s} {p.step_s:9.4g} {p.tokens_per_s:10.4g} {p.mfu:6.1%} "
        f"{_gb(p.memory.device):>8s} {_gb(p.memory.host):>8s} {_gb(p.memory.disk):>8s} "
        f"{_gb(p.intra_node_bytes):>8s} {_gb(p.inter_node_bytes):>8s}  {p.config.label()}"
    )


def _print(result: Plan, workload: Workload, cluster: Cluster, top: int) -> None:
    print(
        f"model: {workload.name or 'transformer'}, Ψ = {workload.params:,.0f}, "
        f"{workload.layers} layers x {workload.width}, {workload.dtype}, batch "
        f"{workload.batch_size} x {workload.context} tokens x {workload.accumulation}"
    )
    print(f"cluster: {cluster.name}, {cluster.nodes} node(s) x {cluster.devices_per_node} "
          f"device(s), {cluster.achieved_flops / 1e12:.3g} TFLOP/s achieved per device; "
          f"{cluster.source}")  # fmt: skip
    header = (f"fit {'step s':>9s} {'tokens/s':>10s} {'MFU':>6s} {'device':>8s} {'host':>8s} "
              f"{'disk':>8s} {'intra':>8s} {'inter':>8s}  configuration  "
              "(memory GB per rank; GB per rank per step on each link)")  # fmt: skip
    print("\nrequested:")
    print(header)
    print(_row(result.requested))
    if result.requested.why_not:
        print(f"    does not fit: {result.requested.why_not}")
    print(f"\nranked ({len(result.ranked)} considered, the first {min(top, len(result.ranked))}):")
    print(header)
    for p in result.ranked[:top]:
        print(_row(p))
    print(f"\nwhy: {result.reason}")


if __name__ == "__main__":
    main()
