"""Launching the DeepSpeed-shaped scripts of this folder on 2 ranks, and reading their steps.

Two ways to run one script at one ZeRO stage and dtype:

    ours(script, stage, dtype, folder)       # the port (port.py) under zero_core.deepspeed,
                                             # launched by zero-launch
    deepspeed(script, stage, dtype, folder)  # the script as written, under real DeepSpeed,
                                             # launched by DeepSpeed's own launcher

Both return the ``Steps`` rank 0 printed (``step N loss X [lr Y]``). The CIFAR-10 script
takes its stage and dtype from a JSON file (``--deepspeed_config``, written here in its
tutorial's shape); the BERT script from flags (``--zero_stage``, ``--dtype``).

Both launchers give each rank ``--local_rank=<n>`` (zero-launch because the scripts declare
it, issue 46 trap 7): the BERT script picks its distributed sampler from it, so a launcher
that passed none would make every rank read the whole data set, and its step count double.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

from .port import port

HERE = Path(__file__).resolve().parent
CIFAR = HERE / "cifar10_deepspeed.py"
BERT = HERE / "bert_deepspeed.py"
SCRIPTS = (CIFAR, BERT)
STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
LAUNCH_TIMEOUT_S = 240
STEPS = 4  # both scripts: 64 images in batches of 8 a rank; 32 sequences in batches of 4
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)(?: lr (\S+))?$")


class Steps(NamedTuple):
    """What rank 0 printed: the loss of each step, and (BERT) the lr after it."""

    losses: tuple[float, ...]
    lrs: tuple[float, ...]
    output: str  # the whole stdout, for failure messages


def cifar_config(stage: int, dtype: str) -> dict[str, Any]:
    """The CIFAR-10 tutorial's ds_config, with its deprecated and disabled keys kept.

    Two changes from the tutorial, both for a 4-step CPU run: ``torch_adam`` (DeepSpeed's
    fused Adam is a compiled op; without pre-built ops it would build it at start) and 3
    warm-up steps instead of 1000 (so the learning rate is not ~0 for the whole run).
    """
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.001,
                "betas": [0.8, 0.999],
                "eps": 1e-8,
                "weight_decay": 3e-7,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 3},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {
            "enabled": dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


def script_arguments(script: Path, stage: int, dtype: str, folder: Path) -> list[str]:
    """The command-line arguments that run ``script`` at ``stage`` in ``dtype``, writing
    what it writes (config, checkpoint, export) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if script.name == CIFAR.name:
        config = folder / "ds_config.json"
        config.write_text(json.dumps(cifar_config(stage, dtype), indent=1))
        return ["--deepspeed", "--deepspeed_config", str(config), "--save_dir",
                str(folder / "checkpoints")]  # fmt: skip
    if script.name == BERT.name:
        return ["--zero_stage", str(stage), "--dtype", dtype, "--output_dir",
                str(folder / "output")]  # fmt: skip
    raise ValueError(f"no arguments known for {script}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ours(script: Path, stage: int, dtype: str, folder: Path) -> Steps:
    """``script``'s port run on 2 ranks under zero_core.deepspeed by zero-launch."""
    ported = port(script, folder / "ported")
    command = [sys.executable, "-m", "zero_comm.launch", "-n", "2", sys.executable,
               str(ported), *script_arguments(script, stage, dtype, folder)]  # fmt: skip
    return _run(command, folder)


def deepspeed(script: Path, stage: int, dtype: str, folder: Path) -> Steps:
    """``script`` as written, on 2 ranks under real DeepSpeed's launcher (CPU, gloo)."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    if launcher is None:
        raise FileNotFoundError(f"DeepSpeed's launcher is not beside {sys.executable}")
    command = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(script),
               *script_arguments(script, stage, dtype, folder)]  # fmt: skip
    return _run(command, folder, {"DS_ACCELERATOR": "cpu"})


def _run(command: list[str], folder: Path, env: dict[str, str] | None = None) -> Steps:
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=folder, timeout=LAUNCH_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited with {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return steps(done.stdout)


def steps(stdout: str) -> Steps:
    """The step lines of ``stdout`` in order; an AssertionError if there are none."""
    losses, lrs = [], []
    for line in stdout.splitlines():
        match = STEP_LINE.match(line.strip())
        if match:
            assert int(match[1]) == len(losses), f"step lines out of order:\n{stdout}"
            losses.append(float(match[2]))
            if match[3] is not None:
                lrs.append(float(match[3]))
    assert losses, f"no 'step N loss X' line in the output:\n{stdout[-3000:]}"
    return Steps(tuple(losses), tuple(lrs), stdout)
