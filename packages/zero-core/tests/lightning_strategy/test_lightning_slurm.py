"""ZeroStrategy under SLURM, emulated on one machine without SLURM.

What is emulated: a job step of ``sbatch --nodes=1 --ntasks-per-node=2`` and ``srun python
slurm_run.py OUT``. The test starts the 2 task processes itself, each with the variables
srun gives a task (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS,
SLURM_NTASKS_PER_NODE, SLURM_NNODES, SLURM_NODELIST, SLURM_JOB_ID, SLURM_JOB_NAME and
their SLURM_STEP_* / SLURM_JOB_* twins) and none of torchrun's (no RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The node list is this machine's host name, which
resolves here, so Lightning's SLURMEnvironment finds the main address as on a cluster; its
main port is ``15000 + the job id's last 4 digits``, so the job id is chosen to give a
free port. No fake ``srun`` or ``scontrol`` is needed: Lightning 2.6.6 detects SLURM by
SLURM_NTASKS (and a job name other than "bash"/"interactive"), runs no SLURM command
during a fit, and only warns when an ``srun`` on PATH was not used.

Also checked under the emulated step: Lightning's SLURM resume path, a fit without
``ckpt_path`` resuming from ``hpc_ckpt_<n>.ckpt`` in its default_root_dir (here
ZeroStrategy's checkpoint folder, saved by hand where the requeue handler would save it).

What a real cluster adds: slurmd starting the tasks (with their CPU binding and cgroups),
several nodes (SLURM_NODEID > 0, the first host of a bracketed node list as the main
address, reached over the network), and the requeue signal (SIGUSR1, which Lightning's Trainer
handles under SLURMEnvironment by saving that checkpoint and calling ``scontrol requeue``);
none of these is exercised here.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning.pytorch")
import torch

pytestmark = pytest.mark.integrations

RUN = Path(__file__).with_name("slurm_run.py")
TASKS = 2
# Set by torchrun, zero-launch, MPI launchers or an outer SLURM job: a task of this step
# must see none of them, or Lightning would pick another cluster environment.
FOREIGN_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI_", "PMIX_", "MPI_", "TORCHELASTIC_")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
LINE = re.compile(r"^slurm_run: environment=.*$", re.MULTILINE)


def _job_id_with_free_port() -> str:
    """A job id whose last 4 digits give a free port under Lightning's rule
    (SLURMEnvironment.main_port: 15000 + int(job_id[-4:]))."""
    for _ in range(100):
        port = random.randint(15000, 24999)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return f"7{port - 15000:04d}"
    raise RuntimeError("no free port in 15000-24999 for the emulated SLURM job")


def _clean_environment() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(FOREIGN_PREFIXES) and name not in TORCHRUN_VARS
    }


def srun_task_environment(task: int, job_id: str, host: str) -> dict[str, str]:
    """The variables srun gives task ``task`` of a 1-node, 2-task step (those Lightning or
    zero_comm read, and their usual companions), over this process's environment."""
    env = _clean_environment()
    per_node = str(TASKS)
    env.update({
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": "zero-slurm-test",
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODELIST": host, "SLURM_JOB_NODELIST": host, "SLURM_STEP_NODELIST": host,
        "SLURMD_NODENAME": host, "SLURM_TOPOLOGY_ADDR": host,
        "SLURM_NTASKS": per_node, "SLURM_NPROCS": per_node, "SLURM_STEP_NUM_TASKS": per_node,
        "SLURM_NTASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_GTIDS": ",".join(str(t) for t in range(TASKS)),
        "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0",
    })  # fmt: skip
    return env


def _srun(out: Path, *, job_name: str | None = None) -> tuple[list[str], str]:
    """Start the 2 tasks of the emulated step; each one's ``slurm_run:`` line, by task,
    and their output's tails (for a failing assertion to show).
    A task that fails or outlives the timeout fails the test, and the other is killed."""
    job_id, host = _job_id_with_free_port(), socket.gethostname()
    tasks = []
    for task in range(TASKS):
        env = srun_task_environment(task, job_id, host)
        if job_name is not None:
            env["SLURM_JOB_NAME"] = job_name
        tasks.append(subprocess.Popen(
            [sys.executable, str(RUN), str(out)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    outputs: list[tuple[int, str, str]] = []
    try:
        for process in tasks:
            stdout, stderr = process.communicate(timeout=300)
            outputs.append((process.returncode, stdout, stderr))
    finally:
        for process in tasks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for task, (code, stdout, stderr) in enumerate(outputs):
        assert code == 0, f"task {task} exited {code}:\n{stdout[-3000:]}{stderr[-6000:]}"
    log = "\n".join(f"task {t}:\n{o[-2000:]}{e[-4000:]}" for t, (_, o, e) in enumerate(outputs))
    return [(LINE.findall(stdout) or ["(no line)"])[-1] for _, stdout, _ in outputs], log


def _launcher(out: Path) -> tuple[list[str], str]:
    """The same fit under Lightning's own launcher (Trainer(devices=2) starts rank 1)."""
    done = subprocess.run(
        [sys.executable, str(RUN), str(out)], env=_clean_environment(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return sorted(LINE.findall(done.stdout)), done.stdout[-2000:] + done.stderr[-4000:]


def _load(out: Path, name: str = "zero3") -> dict[str, Any]:
    result: dict[str, Any] = torch.load(out / f"{name}.pt", weights_only=False)
    return result


def test_a_slurm_step_is_one_world_with_the_launchers_bits(tmp_path: Path) -> None:
    lines, log = _srun(tmp_path / "slurm")
    topology = "topology=slurm:[0, 0]"  # zero_comm read SLURM_NODEID: one node, 2 ranks
    # Ranks 0 and 1 of one world of 2 (two worlds of 1 would both say rank=0).
    assert lines == [
        f"slurm_run: environment=SLURMEnvironment rank={task} world_size=2 "
        f"process_group={task}/2 comm={task}/2 {topology}"
        for task in range(TASKS)
    ], log
    lines, log = _launcher(tmp_path / "launcher")
    assert lines == [
        f"slurm_run: environment=LightningEnvironment rank={rank} world_size=2 "
        f"process_group={rank}/2 comm={rank}/2 topology=hostname:[0, 0]"
        for rank in range(TASKS)
    ], log
    slurm, launcher = _load(tmp_path / "slurm"), _load(tmp_path / "launcher")
    assert slurm["steps"] == launcher["steps"] > 0
    assert slurm["losses"] == launcher["losses"]
    assert list(slurm["params"]) == list(launcher["params"])
    for name, value in launcher["params"].items():
        assert torch.equal(slurm["params"][name], value), f"SLURM vs launcher: {name} differs"
    _assert_hpc_resume(tmp_path / "slurm")


def _assert_hpc_resume(slurm: Path) -> None:
    """Under SLURM a fit without ckpt_path resumes from ``hpc_ckpt_<n>.ckpt`` in its
    default_root_dir (the requeue handler's file; here ZeroStrategy's checkpoint folder):
    it runs only epoch 2 (4 steps, not 8) and ends with the uninterrupted run's bits."""
    whole, resumed = _load(slurm, "zero3_whole"), _load(slurm, "zero3_hpc")
    assert len(resumed["losses"]) == len(whole["losses"]) // 2 > 0
    assert resumed["losses"] == whole["losses"][len(resumed["losses"]) :]
    assert resumed["steps"] == whole["steps"]
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), f"hpc resume: {name} differs"
