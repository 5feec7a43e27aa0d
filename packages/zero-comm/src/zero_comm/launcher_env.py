"""Which launcher started this process, and where it put this process in the world.

Launchers and the variables read, first match wins (MPI before SLURM, because ``mpirun``
inside a SLURM allocation inherits the allocation's SLURM variables):

    launcher        rank                   world size            local rank
    torchrun        RANK                   WORLD_SIZE            LOCAL_RANK
    (zero-launch sets the same variables as torchrun)
    Open MPI        OMPI_COMM_WORLD_RANK   OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK
    MPICH, Intel    PMI_RANK               PMI_SIZE              MPI_LOCALRANKID
    SLURM srun      SLURM_PROCID           SLURM_STEP_NUM_TASKS  SLURM_LOCALID
    none            0                      1                     0

A SLURM batch script itself (no ``srun``) has SLURM_PROCID but no SLURM_STEP_NUM_TASKS and
is treated as a single process, not as rank 0 of a world that never comes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import LaunchEnvError

MPI_LAUNCHERS = ("openmpi", "mpich")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the world, as its launcher described it."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    @property
    def under_mpi_launcher(self) -> bool:
        return self.launcher in MPI_LAUNCHERS


def _int_var(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchEnvError(
                f"environment variable {name} is not set; the launcher must set it"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={raw!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list, each bracket at its first value:
    ``"gpu[07-09,12],cpu1" -> "gpu07"``, ``"rack[1-2]-node[01-04]-ib" -> "rack1-node01-ib"``."""
    text = nodelist.strip()
    host = []
    depth_start = None
    for i, char in enumerate(text):
        if char == "[":
            depth_start = i
        elif char == "]" and depth_start is not None:
            first = text[depth_start + 1 : i].split(",")[0].split("-")[0]
            host.append(first)
            depth_start = None
        elif depth_start is None:
            if char == ",":
                break
            host.append(char)
    name = "".join(host)
    if not name or depth_start is not None or text.startswith(("[", ",")):
        raise LaunchEnvError(f"cannot parse SLURM node list {nodelist!r}; set MASTER_ADDR")
    return name


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR") or None
    port = _int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None
    return addr, port


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables; raises :class:`LaunchEnvError` if they are inconsistent."""
    env = os.environ if environ is None else environ
    addr, port = _master(env)
    names: tuple[str, ...] = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if "RANK" in env or "WORLD_SIZE" in env:
        launcher = env.get("ZERO_LAUNCHER", "torchrun")
        rank, size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        local_rank = _int_var(env, "LOCAL_RANK", 0)
        local_size = _int_var(env, "LOCAL_WORLD_SIZE", size)
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "openmpi"
        names = tuple(f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))
        rank, size = _int_var(env, "OMPI_COMM_WORLD_RANK"), _int_var(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_size = _int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", size)
    elif "PMI_RANK" in env:
        launcher = "mpich"
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        rank, size = _int_var(env, "PMI_RANK"), _int_var(env, "PMI_SIZE")
        local_rank = _int_var(env, "MPI_LOCALRANKID", 0)
        local_size = _int_var(env, "MPI_LOCALNRANKS", size)
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        launcher = "slurm"
        names = (
            "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_LOCALID",
            "SLURM_STEP_TASKS_PER_NODE",
        )
        rank, size = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_STEP_NUM_TASKS")
        local_rank = _int_var(env, "SLURM_LOCALID", 0)
        local_size = (
            _int_var(env, "SLURM_STEP_TASKS_PER_NODE", size)
            if env.get("SLURM_STEP_TASKS_PER_NODE", "").isdigit()
            else size
        )
        if addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            addr = first_slurm_host(nodelist) if nodelist else None
        if port is None and env.get("SLURM_JOB_ID", "").isdigit():
            # A port every task of the step derives alike, and different jobs rarely share.
            port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    else:
        launcher, rank, size, local_rank, local_size = "none", 0, 1, 0, 1
        return LaunchEnv(launcher, rank, size, local_rank, local_size, addr, port)
    rank_var, size_var, local_var, local_size_var = names
    if size < 1:
        raise LaunchEnvError(f"{size_var}={size} ({launcher}): the world size must be at least 1")
    if not 0 <= rank < size:
        raise LaunchEnvError(
            f"{rank_var}={rank} ({launcher}) is outside the world of {size_var}={size}"
        )
    if local_size < 1:
        raise LaunchEnvError(f"{local_size_var}={local_size} ({launcher}) must be at least 1")
    if not 0 <= local_rank < local_size:
        raise LaunchEnvError(
            f"{local_var}={local_rank} ({launcher}) is outside 0..{local_size - 1}"
        )
    if port is not None and not 0 < port < 65536:
        raise LaunchEnvError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return LaunchEnv(launcher, rank, size, local_rank, local_size, addr, port)
