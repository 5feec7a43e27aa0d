"""``zero-plan --calibrate``'s measure of the engine's fixed costs (plan/terms.py's
launch_time, unit_time and step_overhead_time), on every rank of the calibration at once.

Four models go through the real engine (zero_core.initialize on the calibration's
communicator) in a training loop's step as zero-train runs it: the memory tracker's
forward, backward and step phases, the loss's ``item()`` and an all-reduce of two floats
that agrees on it across ranks. Their compute is negligible (4 samples, widths 8 and 72):

    a   one Linear(8, 8), stage 0                            t_a, L_a launches per step
    b   16 Linear(72, 72) (16 fetch units: 5184-element      t_b, L_b
        weights, above the persistence threshold), stage 0
    c   b at stage 3, ZeroConfig's coalescing                t_c, L_c
    d   b at stage 3, nothing coalesced (a launch per unit   t_d, L_d
        and bucket)

Rounds run a, b, c, d in turn, so that a change of the machine's load weighs on all four
alike; t_a is the median over rounds, t_d - t_c and t_c - t_b the medians of one round's
differences. The launches L are the engine's comm.stats calls per step (the agreeing
all-reduce not counted). Then, per rank:

    per launch       (t_d - t_c) / (L_d - L_c)
    launch_overhead  per launch - (R - 1) x hop    (hop: the link's latency per ring hop
                                                    that latency_time already charges)
    unit_overhead    ((t_c - t_b) - (L_c - L_b) x per launch) / (16 units x 2 passes)
    step_overhead    t_a - L_a x per launch

each at least 0 (a difference of two noisy medians can come out below it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

UNITS = 16
UNIT_WIDTH = 72  # 72 x 72 = 5184 elements: above ZeroConfig's persistence threshold (4096)
ROUNDS = 20
WARMUP = 3


def measure_engine_overheads(comm: Any, hop: float, rounds: int = ROUNDS) -> dict[str, float]:
    """Collective over ``comm`` (every rank calls it): the module docstring's three costs,
    in seconds, on this rank. ``hop``: seconds per ring hop the plan charges a collective
    as latency on this machine."""
    from ..config.zero_config import ZeroConfig
    from ..initialize import initialize
    from ..memory.tracker import MemoryTracker

    torch.manual_seed(0)
    tracker = MemoryTracker(comm.device)

    def engine(model: nn.Module, **config: Any) -> Any:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        return initialize(model, optimizer, ZeroConfig(clip_grad_norm=1.0, **config), comm)

    def units() -> nn.Module:
        return nn.Sequential(*[nn.Linear(UNIT_WIDTH, UNIT_WIDTH) for _ in range(UNITS)])

    engines = {
        "a": engine(nn.Sequential(nn.Linear(8, 8)), stage=0),
        "b": engine(units(), stage=0),
        "c": engine(units(), stage=3),
        "d": engine(units(), stage=3, coalesce_numel=0, gather_coalesce_numel=0),
    }
    widths = {"a": 8, "b": UNIT_WIDTH, "c": UNIT_WIDTH, "d": UNIT_WIDTH}
    steps = {name: _step(e, widths[name], tracker, comm) for name, e in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    launches: dict[str, int] = {}
    for round_ in range(WARMUP + rounds):
        for name, step in steps.items():
            seconds, launches[name] = step()
            if round_ >= WARMUP:
                times[name].append(seconds)
    t = {name: statistics.median(values) for name, values in times.items()}

    def paired(later: str, earlier: str) -> float:  # the median of one round's differences
        return statistics.median(x - y for x, y in zip(times[later], times[earlier], strict=True))

    per_launch = max(0.0, paired("d", "c") / max(1, launches["d"] - launches["c"]))
    unit = (paired("c", "b") - (launches["c"] - launches["b"]) * per_launch) / (UNITS * 2)
    return {
        "per_launch_s": per_launch,
        "launch_overhead": max(0.0, per_launch - (comm.world_size - 1) * hop),
        "unit_overhead": max(0.0, unit),
        "step_overhead": max(0.0, t["a"] - launches["a"] * per_launch),
        **{f"step_{name}_s": value for name, value in t.items()},
        **{f"launches_{name}": float(value) for name, value in launches.items()},
    }


def _step(engine: Any, width: int, tracker: Any, comm: Any) -> Callable[[], tuple[float, int]]:
    """One training-loop step of ``engine`` on inputs of ``width`` (module docstring):
    (seconds, the engine's launches)."""
    import zero_comm

    x, y = torch.randn(4, width), torch.randn(4, width)

    def run() -> tuple[float, int]:
        comm.stats.reset()
        start = time.perf_counter()
        with tracker.phase("forward"):
            loss = functional.mse_loss(engine(x), y)
        with tracker.phase("backward"):
            engine.backward(loss)
        with tracker.phase("step"):
            engine.step()
        calls = sum(int(c["calls"]) for k, c in comm.stats.as_dict().items() if k != "broadcast")
        agreed = torch.tensor([loss.item(), 0.0])
        comm.all_reduce(agreed, zero_comm.ReduceOp.AVG)
        return time.perf_counter() - start, calls

    return run
