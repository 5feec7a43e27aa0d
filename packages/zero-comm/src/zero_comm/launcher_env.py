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

Which node a rank is on (:func:`node_key_from_env`, in the same order; a family is used only
where all its variables are set):

    torchrun        GROUP_RANK, with LOCAL_WORLD_SIZE ranks on it
    (zero-launch)   RANK - LOCAL_RANK, the node's first rank, with LOCAL_WORLD_SIZE ranks
    Open MPI        OMPI_COMM_WORLD_RANK - OMPI_COMM_WORLD_LOCAL_RANK, with ..._LOCAL_SIZE
    MPICH, Intel    PMI_RANK - MPI_LOCALRANKID, with MPI_LOCALNRANKS
    SLURM srun      SLURM_NODEID, with SLURM_STEP_TASKS_PER_NODE where it is one number

MPI launchers name no node (Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank among every job's
processes on the node, not a node), so their key assumes each node holds a contiguous block
of ranks; zero_comm.topology checks that against every rank's answer before using it.
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


@dataclass(frozen=True)
class NodeKey:
    """Which node one rank is on, as its launcher's variables say.

    Attributes:
        source: "torchrun", "openmpi", "mpich" or "slurm".
        node: equal on the ranks of one node and different across nodes: the launcher's node
            index, or (``from_local_rank``) the world rank of the node's first rank.
        local_rank: this rank's index among the ranks of its node, where the launcher says.
        local_size: the number of ranks on its node, where the launcher says.
        from_local_rank: ``node`` is ``rank - local_rank``, right only where every node holds
            a contiguous block of ranks (zero_comm.topology checks that across ranks).
    """

    source: str
    node: int
    local_rank: int | None
    local_size: int | None
    from_local_rank: bool


def node_key_from_env(environ: Mapping[str, str] | None = None) -> NodeKey | None:
    """This rank's :class:`NodeKey` from the launcher's variables, or None where no launcher
    said (or only part of what is needed). Raises LaunchEnvError on a non-integer value."""
    env = os.environ if environ is None else environ

    def has(*names: str) -> bool:
        return all(env.get(name, "") != "" for name in names)

    if has("RANK", "GROUP_RANK"):
        size = _int_var(env, "LOCAL_WORLD_SIZE") if has("LOCAL_WORLD_SIZE") else None
        local = _int_var(env, "LOCAL_RANK") if has("LOCAL_RANK") else None
        return NodeKey("torchrun", _int_var(env, "GROUP_RANK"), local, size, False)
    families = (
        ("torchrun", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("openmpi", *(f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "LOCAL_RANK", "LOCAL_SIZE"))),
        ("mpich", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    )
    for source, rank_var, local_var, size_var in families:
        if has(rank_var, local_var, size_var):
            rank, local = _int_var(env, rank_var), _int_var(env, local_var)
            return NodeKey(source, rank - local, local, _int_var(env, size_var), True)
    if has("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NODEID"):
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "")
        local = _int_var(env, "SLURM_LOCALID") if has("SLURM_LOCALID") else None
        size = int(per_node) if per_node.isdigit() else None  # "2(x3),1": nodes differ
        return NodeKey("slurm", _int_var(env, "SLURM_NODEID"), local, size, False)
    return None


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
