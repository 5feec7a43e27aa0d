"""Every tensor the engine makes is on the communicator's device, or named as host memory.

A factory call without ``device`` makes a CPU tensor. On CPU test machines that is the
right device by accident, and the bug shows only on a GPU: the first GPU run of
tools/gpu/check.py failed at every stage with "all_gather: output is on cpu" (the stage 3
gather buffers) and "assigning a gradient with device type 'cpu'" (the stage 0-2 gradient
buffers). These tests train every stage and tier under :class:`ImplicitDeviceCalls`, which
records each factory call from our packages that does not name a device, and ask for none.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from implicit_device import ImplicitDeviceCalls
from parity import ParityCase, build_engine, normalised, run_steps

from zero_comm import Communicator, run_simulated


def test_the_check_sees_a_call_without_device_from_our_packages() -> None:
    mode = ImplicitDeviceCalls()
    planted = compile(
        "torch.zeros(3)\ntorch.zeros(3, device='cpu')", "/x/zero_core/planted.py", "exec"
    )
    with mode:
        exec(planted, {"torch": torch})
    assert mode.calls == {"/x/zero_core/planted.py:1"}


def test_the_check_leaves_calls_made_inside_torch_and_by_tests() -> None:
    mode = ImplicitDeviceCalls()
    with mode:
        torch.nn.Linear(2, 3)  # torch's own torch.empty: not ours
        torch.zeros(3)  # this test file: not one of our packages
    assert mode.calls == set()


def _train_and_round_trip(case: ParityCase, stage: int, settings: dict[str, Any], folder: str):
    def body(comm: Communicator) -> set[str]:
        mode = ImplicitDeviceCalls()
        with mode:
            c = normalised(case)
            engine = build_engine(c, comm, stage, settings)
            run_steps(engine, c, comm, range(c.steps))  # the full state after each step too
            engine.memory_report()
            engine.save(folder)
            engine.load(folder)
            engine.close()
        return mode.calls

    return body


BASE = {"vocab": 11, "tie": True, "clip": 0.5, "accumulation": 2, "bucket_numel": 64}
CASES = [
    *[
        (stage, {**BASE, "dtype": dtype}, {}, 2)
        for stage in range(4)
        for dtype in ("float32", "float16")
    ],
    (3, {**BASE, "dtype": "bfloat16", "persistence_threshold": 20, "prefetch_numel": 100}, {}, 2),
    (
        2,
        {"vocab": 11, "dtype": "bfloat16", "offload_optimizer": "cpu", "offload_fraction": 0.5},
        {},
        2,
    ),
    (
        3,
        {
            "vocab": 11,
            "dtype": "bfloat16",
            "offload_optimizer": "disk",
            "offload_params": "disk",
            "sub_group_numel": 64,
        },
        {},
        2,
    ),
    (1, {"vocab": 11, "dtype": "bfloat16"}, {"shard_group_size": 2}, 4),
    (
        3,
        {"vocab": 11, "dtype": "bfloat16", "persistence_threshold": 0},
        {"hpz_partition_size": 2, "quantize_weights": True, "quantize_gradients": "int4"},
        4,
    ),
    (
        3,
        {"vocab": 11, "dtype": "bfloat16"},
        {"shard_group_size": 2, "hierarchical_gather": True},
        4,
    ),
]


@pytest.mark.parametrize(("stage", "fields", "settings", "world_size"), CASES)
def test_training_and_checkpoints_name_every_device(
    stage: int, fields: dict[str, Any], settings: dict[str, Any], world_size: int
) -> None:
    case = ParityCase(**fields)
    with tempfile.TemporaryDirectory() as folder:
        calls = run_simulated(world_size, _train_and_round_trip(case, stage, settings, folder))
    found = set().union(*calls)
    assert not found, (
        "tensors made without a device (CPU by accident; wrong on a GPU): "
        + ", ".join(sorted(found))
        + "; pass device=comm.device, or device='cpu' for host memory"
    )
