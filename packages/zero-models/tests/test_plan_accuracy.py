"""zero-plan against zero-train on this machine (issue 51, point 3): the predicted step
time of the default GPT (small, 2 ranks, gloo, fp32, one thread per rank) within 30% of
zero-train's measured one, at stages 0-3 and at stage 3 with disk offload.

The machine may be shared, and its load moves from second to second, which moves both the
measured step and the calibration. So calibrations (2 processes at once, as the 2 ranks
run; zero_core.plan.calibrate at the model's width only, windows a quarter of the default)
and runs alternate: calibrate, run stage 0, calibrate, run stage 1, ..., calibrate. Each
run is bracketed by the calibration just before and the one just after it, and its
prediction is the mean of theirs. The measured step is the median of zero-train's step_s
(the slowest rank's) over the steps after the first two (warm-up). The tolerance, 30%, is
the issue's. Also, the mirror of zero-train's GPT presets in zero_core.plan.workload
equals zero_models.gpt's, and plan/launches.py counts the collectives the engine launches.

The step-time cases are in the slow session (nox -s slow), not the default run: the six
calibrations and five zero-train runs take 1.5-4 minutes on the shared 2-core machine
(past the default run's budget), and at load 4-8 the calibration and the run disagree by
up to 2x in either direction (docs/plan.md, "Validation on this machine").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zero_core.plan import PlanConfig, predict, workload_from_gpt
from zero_core.plan.calibrate import calibrate
from zero_core.plan.presets import this_machine
from zero_core.plan.workload import GPT_PRESETS, gpt_params
from zero_models.gpt import PRESETS

TOLERANCE = 0.30
STEPS = 10
WINDOW = 0.25  # of calibrate's measuring windows: 6 calibrations in the test
CASES = {
    "stage 0": PlanConfig(stage=0),
    "stage 1": PlanConfig(stage=1),
    "stage 2": PlanConfig(stage=2),
    "stage 3": PlanConfig(stage=3),
    "stage 3, disk": PlanConfig(stage=3, offload_optimizer="disk", offload_params="disk"),
}


def test_gpt_presets_are_mirrored() -> None:
    """zero_core.plan.workload.GPT_PRESETS (zero_core may not import zero_models) holds
    zero_models.gpt.PRESETS' shapes, and gpt_params their parameter counts."""
    assert set(GPT_PRESETS) == set(PRESETS)
    for name, config in PRESETS.items():
        mirror = GPT_PRESETS[name]
        for field in ("vocab_size", "context", "layers", "heads", "width"):
            assert getattr(mirror, field) == getattr(config, field), (name, field)
        assert gpt_params(config.vocab_size, config.context, config.layers, config.width) == (
            config.num_params
        )
        assert workload_from_gpt(name).params == config.num_params


LAUNCH_CASES = [
    ("test", 0, 2, {}),
    ("tiny", 3, 2, {}),
    ("small", 0, 2, {"bucket_numel": 2**16}),
    ("small", 1, 4, {"bucket_numel": 2**15}),
    ("small", 2, 2, {"bucket_numel": 2**16}),
    ("small", 3, 2, {}),
    ("small", 3, 2, {"bucket_numel": 2**14}),
    ("small", 3, 2, {"gather_coalesce_numel": 0, "prefetch_numel": 2**16}),
    ("small", 3, 4, {"backward_head_numel": 2**16}),
    ("small", 3, 4, {"bucket_numel": 2**15, "prefetch_numel": 0}),  # units of 2 buckets
    ("small", 3, 2, {"bucket_numel": 2**15, "backward_head_numel": 0}),
]


@pytest.mark.parametrize(("model", "stage", "ranks", "settings"), LAUNCH_CASES)
def test_launches_are_the_engines(
    model: str, stage: int, ranks: int, settings: dict[str, int]
) -> None:
    """plan/launches.py's count of a step's collectives equals what the engine launches
    (comm.stats' calls, a step after the first, which records stage 3's prefetch order)
    for zero-train's GPTs on a simulated world: the launch and latency terms count
    what runs."""
    import torch
    from torch.nn import functional

    import zero_core
    from zero_comm import Communicator, run_simulated
    from zero_core.plan.launches import count_launches
    from zero_models.gpt import GPT

    calls: list[int] = []

    def body(comm: Communicator) -> None:
        torch.manual_seed(0)
        config = PRESETS[model]
        gpt = GPT(config)
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
        zero = zero_core.ZeroConfig(stage=stage, clip_grad_norm=1.0, **settings)  # type: ignore[arg-type]
        engine = zero_core.initialize(gpt, optimizer, zero, comm)
        tokens = torch.randint(0, config.vocab_size, (2, config.context))
        for _ in range(2):
            comm.stats.reset()
            logits = engine(tokens)
            engine.backward(functional.cross_entropy(logits.view(-1, config.vocab_size),
                                                     tokens.view(-1)))  # fmt: skip
            engine.step()
        if comm.rank == 0:
            calls.append(sum(c["calls"] for k, c in comm.stats.as_dict().items()
                             if k != "broadcast"))  # fmt: skip

    run_simulated(ranks, body)
    launches = count_launches(workload_from_gpt(model), PlanConfig(stage=stage, **settings), ranks)
    assert launches.per_step(1) == calls[0], launches


def zero_train_flags(config: PlanConfig, swap: Path) -> list[str]:
    flags = ["--stage", str(config.stage)]
    if config.offload_optimizer != "none":
        flags += ["--offload-optimizer", config.offload_optimizer, "--offload-dir", str(swap)]
    if config.offload_params != "none":
        flags += ["--offload-params", config.offload_params]
    return flags


def measured_step(flags: list[str], out: Path) -> float:
    """zero-train's median step_s after two warm-up steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "zero_models.train",
        *flags,
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--overwrite",
        "--no-final-save",
        "--sample-tokens",
        "0",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step_s"] for line in lines if line.startswith('{"step"')]
    return statistics.median(steps[2:])


def predictions(calibration: dict[str, Any]) -> dict[str, float]:
    """Every case's predicted step from one calibration."""
    workload = workload_from_gpt("small")
    cluster = this_machine(calibration, ranks=2, width=workload.width)
    return {name: predict(workload, cluster, config).step_s for name, config in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[float, float, str]]:
    """Per case: (measured, predicted, a line for the report), calibrations and runs
    alternating (module docstring)."""
    folder = tmp_path_factory.mktemp("plan-accuracy")
    swap = folder / "swap"
    swap.mkdir()

    def calibrated(index: int) -> tuple[dict[str, float], float]:
        data = calibrate(folder / f"calibration-{index}.json", widths=[128], window=WINDOW)
        return predictions(data), data["matmul_flops"]["128"] / 1e9

    before, rate_before = calibrated(0)
    out: dict[str, tuple[float, float, str]] = {}
    for index, (name, config) in enumerate(CASES.items(), start=1):
        measured = measured_step(zero_train_flags(config, swap), folder / "run")
        load = os.getloadavg()[0]
        after, rate_after = calibrated(index)
        predicted = (before[name] + after[name]) / 2
        line = (f"{name}: measured {measured:.4f} s, predicted {predicted:.4f} s "
                f"({predicted / measured - 1:+.0%}; before {before[name]:.4f}, after "
                f"{after[name]:.4f}); load average {load:.1f}; matmul {rate_before:.1f} / "
                f"{rate_after:.1f} GFLOP/s per rank")  # fmt: skip
        print(line)
        out[name] = (measured, predicted, line)
        before, rate_before = after, rate_after
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # the fixture's 6 calibrations and 5 runs: 5 min at load 8 here
@pytest.mark.parametrize("name", list(CASES))
def test_step_time_is_predicted(name: str, results: dict[str, tuple[float, float, str]]) -> None:
    measured, predicted, line = results[name]
    assert abs(predicted / measured - 1) <= TOLERANCE, line


def test_zero_plan_takes_every_zero_train_option() -> None:
    """zero-plan's parser knows every option string of zero-train's (used, or accepted and
    ignored where it does not change a step), so a zero-train command line plans as is."""
    from zero_core.plan.command import build_parser
    from zero_models.train_options import parser

    known = set(build_parser()._option_string_actions)
    missing = [o for a in parser()._actions for o in a.option_strings if o not in known]
    assert not missing, missing
