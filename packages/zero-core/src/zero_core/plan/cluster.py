"""The hardware a plan is for: one frozen :class:`Cluster`, from a preset, JSON or flags.

Every rate is per device unless named per node, in bytes (1 GB = 1e9 B) and seconds, one
direction. The link model (plan/collectives.py) is the one zero_comm.stats counts by:

    intra-node link   each device sends to the next in its node at ``intra_bandwidth``
    inter-node link   a node sends to the other nodes at ``inter_bandwidth`` (all of its
                      NICs together), so a step's inter-node time is its inter-node bytes
                      per node / ``inter_bandwidth``

A JSON file holds the field names below (``Cluster.to_json``); rates may also be given as
strings with units ("100Gbit/s", "25GB/s", "32GiB", "125TFLOP/s").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    """One cluster (see the module docstring for units and the link model).

    ``compute_efficiency`` is the achieved fraction of ``peak_flops`` for the model's
    dense matmuls (calibrated here, fitted once per hardware preset elsewhere; its source
    goes in ``source``). ``op_overhead`` is the fixed time of one operator (Python
    dispatch, kernel launch), paid per operator of forward and backward;
    ``launch_overhead``, ``unit_overhead`` and ``step_overhead`` are the engine's fixed
    costs per collective launch, per stage 3 fetch unit and pass, and the training loop's
    per step (plan/terms.py; calibrated here, 0 on the hardware presets, whose steps are
    seconds long, where these are milliseconds at most). ``overlap`` is
    the fraction of communication and copies that can run while compute runs: 1 where
    collectives and copies have engines of their own (GPUs: NCCL's kernels, copy
    streams), 0 where they share the cores that compute (gloo on CPUs with no idle core).
    """

    name: str
    nodes: int
    devices_per_node: int
    device_memory: float  # bytes
    peak_flops: float  # FLOP/s in the compute dtype, dense matmul
    compute_efficiency: float  # achieved / peak for the model's matmuls
    memory_bandwidth: float  # bytes/s of the device's own memory (elementwise, optimizer)
    intra_bandwidth: float  # bytes/s a device sends within its node
    intra_latency: float  # s per collective hop within a node
    inter_bandwidth: float  # bytes/s a node sends to other nodes (all its NICs)
    inter_latency: float  # s per collective hop across nodes
    host_memory: float  # bytes per node
    host_bandwidth: float  # bytes/s device <-> host per device (PCIe); CPU devices: memcpy
    host_optimizer_rate: float  # float32 elements/s the host's optimizer steps per device
    disk_bandwidth: float  # bytes/s per node, read or write, through the swap pipeline
    disk_bytes: float = math.inf  # bytes of swap space per node
    optimizer_rate: float = 0.0  # float32 elements/s the device's optimizer steps (0: bandwidth/28)
    activation_bandwidth: float = (
        0.0  # bytes/s of elementwise work on activations (0: memory_bandwidth)
    )
    op_overhead: float = 10e-6  # s per operator
    launch_overhead: float = 0.0  # s of the engine's own work per collective launch
    unit_overhead: float = 0.0  # s per stage 3 fetch unit and pass (0: 12 operators)
    step_overhead: float = 0.0  # s per step of the training loop, whatever the model
    overlap: float = 1.0  # fraction of communication that can hide behind compute
    codec_rate: float = 0.0  # elements/s qwZ/qgZ code or decode per device (0: memory bound)
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(value, str):
                    raise TypeError(f"Cluster.{f.name}={value!r} must be a string")
                continue
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"Cluster {self.name!r}: {f.name}={value!r} must be a number >= 0")
        for name in ("nodes", "devices_per_node"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(
                    f"Cluster {self.name!r}: {name}={getattr(self, name)!r} must be an integer >= 1"
                )
        for name in ("peak_flops", "compute_efficiency", "memory_bandwidth", "intra_bandwidth",
                     "host_bandwidth", "host_optimizer_rate", "disk_bandwidth"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster {self.name!r}: {name} must be > 0, got 0")
        if self.nodes > 1 and self.inter_bandwidth <= 0:
            raise ValueError(f"Cluster {self.name!r}: {self.nodes} nodes need inter_bandwidth > 0")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Cluster {self.name!r}: overlap={self.overlap} must be in [0, 1]")

    @property
    def world_size(self) -> int:
        """Devices in all: nodes x devices_per_node."""
        return self.nodes * self.devices_per_node

    @property
    def achieved_flops(self) -> float:
        """FLOP/s one device achieves on the model's matmuls: peak x efficiency."""
        return self.peak_flops * self.compute_efficiency

    def with_(self, **changes: Any) -> Cluster:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Field names to plain numbers (inf as the string "inf")."""
        return {k: ("inf" if v == math.inf else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any], base: Cluster | None = None) -> Cluster:
        """A cluster from ``data`` (field names; values numbers or strings with units),
        fields not given taken from ``base``; unknown names raise, naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"cluster description: unknown field(s) {unknown}; the fields are {sorted(known)}"
            )
        values = asdict(base) if base is not None else {}
        for key, value in data.items():
            values[key] = value if key in ("name", "source") else parse_quantity(value, key)
        missing = sorted(known - set(values) - {f.name for f in fields(cls) if _has_default(f)})
        if missing:
            raise ValueError(f"cluster description: missing field(s) {missing}")
        for key in ("nodes", "devices_per_node"):
            values[key] = int(values[key])
        return cls(**values)

    @classmethod
    def load(cls, path: Path, base: Cluster | None = None) -> Cluster:
        """``from_json`` of the JSON file at ``path``."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cluster file {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"cluster file {path}: expected a JSON object of Cluster fields")
        return cls.from_json(data, base)


def _has_default(f: Any) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


_UNITS = {
    "": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9.eE+-]+)\s*([kmgtp]i?)?\s*(bit|b|flop|byte)?s?(/s)?\s*$", re.I)


def parse_quantity(value: Any, what: str = "value") -> float:
    """A number, or a string with a unit: "100Gbit/s" -> 12.5e9 (bytes/s), "25GB/s" ->
    25e9, "32GiB" -> 34359738368, "125TFLOP/s" -> 1.25e14, "inf" -> inf."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r}: expected a number")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value)
    if text.strip().lower() == "inf":
        return math.inf
    match = _QUANTITY.match(text)
    if not match:
        raise ValueError(
            f"{what}={text!r}: expected a number or one with a unit, like 100Gbit/s, "
            "25GB/s, 32GiB, 125TFLOP/s"
        )
    number, prefix, unit, _ = match.groups()
    scale = _UNITS[(prefix or "").lower()]
    if unit and unit.lower() == "bit":
        scale /= 8
    try:
        return float(number) * scale
    except ValueError as exc:
        raise ValueError(f"{what}={text!r}: {exc}") from exc
