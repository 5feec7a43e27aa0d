"""``zero-plan --calibrate``: measure this machine's rates, store them, load them.

What is measured, by ``ranks`` local processes at once (default 2, zero-train's default
--nproc), one intra-op thread each, as zero-train runs its ranks on a machine with as many
cores as ranks, so that the machine's other load weighs on the measure as on a run; each
over a window of 0.5-2 s, the median over chunks of 0.1 s (a small model's step: a shared
machine's load comes and goes in time slices) of the mean time of a call within the chunk
(_mean_time), then the mean over the processes:

    matmul_flops      FLOP/s of a transformer block's matmuls, n = 1024 tokens at widths
                      64 ... 1024: (n x C)(C x 3C), (n x C)(C x C), (n x C)(C x 4C),
                      (n x 4C)(4C x C), forward and the two of backward each
    op_overhead       s per operator: forward and backward of a pre-LayerNorm block at
                      width 8 on 4 tokens / terms.OPS_PER_BLOCK
    block_residual_s  s of a block's forward and backward at each width on 8 x 128 tokens
                      beyond its matmuls at matmul_flops: its elementwise work (LayerNorm,
                      GELU, attention's kernel, residuals); a plan turns it into the rate
                      of terms.activation_time
    memory_bandwidth  bytes/s of out = b + s c on 2^23 float32 elements (12 bytes each)
    optimizer_rate    float32 elements/s of torch.optim.AdamW's step (its default
                      implementation, as zero-train builds it) on 2^20 elements
    gloo              the processes on zero_comm (gloo, loopback): all_gather of 4 KiB and
                      16 MiB (the slowest rank's); latency = the small one's time per ring
                      hop, bandwidth = the bytes one rank sends ((R-1)/R of the output) /
                      (large time - small time); sync_s = what a small all_gather adds
                      between stretches of compute (the ranks' skew included: _sync_cost)
    engine            the engine's fixed costs, the mean over the processes: per collective
                      launch beyond the latency, per stage 3 fetch unit and pass, and a
                      training loop's step (plan/calibrate_engine.py)

Stored as JSON at $ZERO_PLAN_CALIBRATION, else $XDG_CACHE_HOME/zero/calibration.json
(~/.cache/zero/calibration.json), with the machine's CPU count and when it was measured.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .calibrate_engine import measure_engine_overheads
from .terms import OPS_PER_BLOCK

ENV_VAR = "ZERO_PLAN_CALIBRATION"
WIDTHS = (64, 128, 256, 512, 1024)
TOKENS = 1024
CHUNK_S = 0.1  # the chunks _mean_time takes the median over: about a small model's step


def calibration_path() -> Path:
    """Where the calibration is stored (module docstring)."""
    given = os.environ.get(ENV_VAR)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "zero" / "calibration.json"


def load_calibration(path: Path | None = None) -> dict[str, Any] | None:
    """The stored calibration, or None if there is none (or it is unreadable)."""
    path = path or calibration_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and "matmul_flops" in data else None


def _mean_time(
    fn: Callable[[], object], seconds: float, warmup: int = 2, chunk: float = CHUNK_S
) -> float:
    """Time of one call of ``fn``, over calls repeated for at least ``seconds``: the median
    over chunks of at least ``chunk`` seconds (a training step's length) of the chunk's mean
    time per call. A mean within a step-long chunk, since a shared machine's load comes and
    goes in time slices of milliseconds, which a median of short calls would step between;
    the median over chunks, as the accuracy test takes the median step, so that a burst of
    another process's work that stalls one chunk moves neither."""
    for _ in range(warmup):
        fn()
    means: list[float] = []
    start = time.perf_counter()
    while not means or time.perf_counter() - start < seconds:
        calls, begun = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - begun
            if elapsed >= chunk:
                means.append(elapsed / calls)
                break
    return statistics.median(means)


Timer = Callable[[Callable[[], object], float], float]


def measure_matmul(
    width: int, tokens: int = TOKENS, seconds: float = 2.0, timer: Timer | None = None
) -> float:
    """FLOP/s of one block's matmul shapes at ``width`` (module docstring)."""
    c, n = width, tokens
    shapes = [(n, c, 3 * c), (n, c, c), (n, c, 4 * c), (n, 4 * c, c)]
    mats = [(torch.randn(m, k), torch.randn(k, o), torch.randn(m, o)) for m, k, o in shapes]

    def run() -> None:
        for x, w, dy in mats:
            x @ w  # forward
            dy @ w.t()  # gradient of the input
            x.t() @ dy  # gradient of the weight

    flops = sum(3 * 2 * m * k * o for m, k, o in shapes)
    return flops / (timer or _mean_time)(run, seconds)


class _Block(torch.nn.Module):
    """zero_models.gpt.Block's operators (pre-LayerNorm attention and 4C GELU MLP)."""

    def __init__(self, c: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.fc, self.out = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)
        out: torch.Tensor = x + self.out(torch.nn.functional.gelu(self.fc(self.ln_2(x))))
        return out


def measure_block_residual(
    width: int, matmul_flops: float, seconds: float = 1.0, timer: Timer | None = None
) -> float:
    """Seconds of a block's forward and backward at ``width`` on 8 x 128 tokens that its
    matmuls at ``matmul_flops`` do not explain: LayerNorm, GELU, attention's kernel,
    residuals, gradient accumulation (its elementwise work)."""
    heads = max(1, width // 32)
    block = _Block(width, heads)
    x = torch.randn(8, 128, width, requires_grad=True)

    def run() -> None:
        block(x).sum().backward()

    flops = 6 * 12 * width * width * 1024 + 12 * 128 * width * 1024
    return max(0.0, (timer or _mean_time)(run, seconds) - flops / matmul_flops)


def measure_op_overhead(seconds: float = 0.5, timer: Timer | None = None) -> float:
    """Seconds per operator (module docstring)."""
    blocks = torch.nn.Sequential(*[_Block(8, 2) for _ in range(4)])
    x = torch.randn(1, 4, 8, requires_grad=True)

    def run() -> None:
        blocks(x).sum().backward()

    return (timer or _mean_time)(run, seconds) / (4 * OPS_PER_BLOCK)


def measure_memory_bandwidth(
    numel: int = 2**23, seconds: float = 0.5, timer: Timer | None = None
) -> float:
    """Bytes/s of out = b + s c (12 bytes per float32 element)."""
    b, c, out = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    add = functools.partial(torch.add, b, c, alpha=0.5, out=out)
    return 12 * numel / (timer or _mean_time)(add, seconds)


def measure_optimizer(
    numel: int = 2**20, seconds: float = 0.5, timer: Timer | None = None
) -> float:
    """float32 elements/s of torch.optim.AdamW's step (its default implementation)."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    return numel / (timer or _mean_time)(optimizer.step, seconds)


def _worker() -> None:
    """One of the processes of :func:`calibrate` (this module run with --worker): every
    rank measures at once, as zero-train's ranks compute at once; rank 0 prints the mean
    rate over ranks and the slowest collective time."""
    import zero_comm

    torch.set_num_threads(1)
    comm = zero_comm.init("gloo", check_consistency=False)
    widths = [int(w) for w in os.environ.get("ZERO_PLAN_WIDTHS", "").split(",") if w] or WIDTHS
    scale = float(os.environ.get("ZERO_PLAN_WINDOW", "1"))  # of every measuring window

    # Each measure is a mean over a window as long as a step, every rank at once (a timer
    # calling after a barrier each time measured rates about 1.5x those zero-train's steps
    # then achieved on this shared machine, and was dropped).
    comm.barrier()
    rates = [measure_matmul(w, seconds=2.0 * scale) for w in widths]
    residuals = [
        measure_block_residual(w, rate, seconds=scale)
        for w, rate in zip(widths, rates, strict=True)
    ]
    rates += [
        1 / measure_op_overhead(seconds=0.5 * scale),
        measure_memory_bandwidth(seconds=0.5 * scale),
        measure_optimizer(seconds=0.5 * scale),
    ]
    collective = {}
    for label, numel in (("small", 1024), ("large", 2**22)):
        shard, full = torch.ones(numel // comm.world_size), torch.empty(numel)
        comm.barrier()
        gather = functools.partial(comm.all_gather, full, shard)
        for _ in range(3):  # warm-up; then a count every rank agrees on (a collective)
            gather()
        calls = 8 if label == "large" else 100
        start = time.perf_counter()
        for _ in range(calls):
            gather()
        collective[label] = (time.perf_counter() - start) / calls
    collective["sync"] = _sync_cost(comm)
    # The engine's fixed costs, charged beyond the latency this machine's plan uses.
    hop = max(collective["small"] / (comm.world_size - 1), collective["sync"])
    overheads = measure_engine_overheads(comm, hop, rounds=max(8, round(20 * scale)))
    engine = torch.tensor(list(overheads.values()), dtype=torch.float64)
    comm.all_reduce(engine, zero_comm.ReduceOp.AVG)
    mean = torch.tensor(rates + residuals, dtype=torch.float64)
    comm.all_reduce(mean, zero_comm.ReduceOp.AVG)
    slowest = torch.tensor(
        [collective["small"], collective["large"], collective["sync"]], dtype=torch.float64
    )
    comm.all_reduce(slowest, zero_comm.ReduceOp.MAX)
    if comm.rank == 0:
        values = mean.tolist()
        sent = 2**22 * 4 * (comm.world_size - 1) / comm.world_size  # ring: bytes a rank sends
        latency = float(slowest[0]) / (comm.world_size - 1)  # per hop
        print(json.dumps({
            "matmul_flops": {str(w): r for w, r in zip(widths, values, strict=False)},
            "op_overhead": 1 / values[len(widths)],
            "memory_bandwidth": values[len(widths) + 1],
            "optimizer_rate": values[len(widths) + 2],
            "block_residual_s": {
                str(w): r for w, r in zip(widths, values[len(widths) + 3 :], strict=True)
            },
            "gloo": {"latency_s": latency,
                     "bandwidth": sent / max(float(slowest[1]) - float(slowest[0]), 1e-9),
                     "sync_s": float(slowest[2])},
            "engine": dict(zip(overheads, engine.tolist(), strict=True)),
        }), flush=True)  # fmt: skip
    comm.close()


def _sync_cost(comm: Any, calls: int = 40) -> float:
    """Seconds one small collective costs issued asynchronously before a stretch of
    compute (about 5 ms of matmuls, as a block's) and waited for after it, as the engine
    runs its buckets and gathers: (time with it) - (time of the compute alone), per call.
    Beyond the back-to-back latency, this holds the backend's thread waiting for a core
    the compute holds, and the ranks' skew: one waits for the other, whose compute the
    machine's load stretched."""
    x, w = torch.randn(1024, 128), torch.randn(128, 512)
    shard, full = torch.ones(512), torch.empty(512 * comm.world_size)

    def compute() -> None:
        for _ in range(4):
            x @ w

    def loop(with_collective: bool) -> float:
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            handle = comm.all_gather(full, shard, async_op=True) if with_collective else None
            compute()  # the collective runs on the backend's thread meanwhile, as in a step
            if handle is not None:
                handle.wait()
        comm.barrier()
        return time.perf_counter() - start

    loop(True)  # warm-up
    both, alone, both_again = loop(True), loop(False), loop(True)
    return max(0.0, ((both + both_again) / 2 - alone) / calls)


def calibrate(
    path: Path | None = None,
    *,
    ranks: int = 2,
    widths: Sequence[int] = WIDTHS,
    timeout: float = 300.0,
    window: float = 1.0,
) -> dict[str, Any]:
    """Measure everything (module docstring) in ``ranks`` local processes at once (one
    intra-op thread each), the matmuls at ``widths`` (fewer: quicker), every measuring
    window ``window`` times its length (shorter: quicker, noisier), store it at ``path``
    (default calibration_path()) and return it."""
    from zero_comm.launch import free_port, rank_environment

    if ranks < 2:
        raise ValueError(f"ranks={ranks}: the loopback collectives need at least 2 processes")
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", ZERO_PLAN_WIDTHS=",".join(map(str, widths)),
                ZERO_PLAN_WINDOW=str(window))  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "zero_core.plan.calibrate", "--worker"],
            env=rank_environment(base, rank, ranks, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(proc.returncode for proc in procs):
        errors = " | ".join(err.strip().splitlines()[-1] for _, err in outputs if err.strip())
        raise RuntimeError(f"zero-plan --calibrate: a measuring process failed: {errors}")
    data: dict[str, Any] = {
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count() or 1,
        "ranks": ranks,
        "threads": 1,
        "torch": torch.__version__,
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }
    data.update(json.loads(outputs[0][0].strip().splitlines()[-1]))
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def matmul_rate(calibration: dict[str, Any], width: int) -> float:
    """The calibrated matmul FLOP/s at ``width``, interpolated in log(width) between the
    measured widths (the nearest end outside them)."""
    points = sorted((int(w), float(r)) for w, r in calibration["matmul_flops"].items())
    if width <= points[0][0]:
        return points[0][1]
    for (w0, r0), (w1, r1) in itertools.pairwise(points):
        if width <= w1:
            f = (math.log(width) - math.log(w0)) / (math.log(w1) - math.log(w0))
            return r0 + f * (r1 - r0)
    return points[-1][1]


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        print(json.dumps(calibrate(), indent=1))
