"""``init_distributed`` and ``add_config_arguments``, as DeepSpeed spells them.

DeepSpeed keeps its process group in a global (``deepspeed.comm``); scripts call
``deepspeed.init_distributed()`` once and never pass it around. The facade keeps the one
communicator that call made (``zero_comm.init(deterministic=True)``) in
:data:`WORLD`, and ``initialize`` uses it, or makes it the same way, or takes one passed
explicitly (``initialize(..., comm=...)``: tests and frameworks that own the world).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass

import zero_comm
from zero_comm import Communicator

from .unsupported import refuse_unless_default, unsupported

# DeepSpeed's backend names -> zero_comm's ("ccl", "hccl", ... have no zero_comm backend).
BACKENDS = {None: "auto", "nccl": "nccl", "gloo": "gloo", "mpi": "mpi"}
DEFAULT_PORT = 29500  # DeepSpeed's distributed_port default (TORCH_DISTRIBUTED_DEFAULT_PORT)


@dataclass
class World:
    """The communicator ``init_distributed`` made for this process (None before)."""

    comm: Communicator | None = None


WORLD = World()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> Communicator:
    """Make this process's communicator from its launcher's environment (torchrun,
    zero-launch, mpirun/mpiexec, srun: zero_comm.init reads each), deterministic, once;
    later calls return the same one. Returns it (DeepSpeed returns None: ignore it there).

    ``dist_backend``: "nccl", "gloo", "mpi" or None (zero_comm's "auto"). ``timeout``
    bounds the rendezvous and every collective. MPI discovery is always on (zero_comm
    reads MPI launchers itself); rank, world size, port and init_method come from the
    launcher's environment, so giving them is refused rather than silently overridden.
    ``verbose``, ``config`` and ``dist_init_required`` change nothing here."""
    if dist_backend not in BACKENDS:
        raise unsupported(
            f"init_distributed(dist_backend={dist_backend!r})",
            "zero_comm runs over 'nccl', 'gloo' or 'mpi' (None picks one)",
        )
    refuse_unless_default(
        "init_distributed",
        {
            "init_method": (init_method, None, "zero_comm reads the launcher's environment"),
            "rank": (rank, -1, "the launcher sets RANK (torchrun, zero-launch, mpirun)"),
            "world_size": (world_size, -1, "the launcher sets WORLD_SIZE"),
            "distributed_port": (distributed_port, DEFAULT_PORT, "set MASTER_PORT instead"),
            "auto_mpi_discovery": (auto_mpi_discovery, True, "zero_comm always reads MPI"),
        },
    )
    if WORLD.comm is None:
        backend = BACKENDS[dist_backend]
        if timeout is None:
            WORLD.comm = zero_comm.init(backend, deterministic=True)
        else:
            seconds = (
                timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
            )
            WORLD.comm = zero_comm.init(backend, deterministic=True, timeout=float(seconds))
    return WORLD.comm


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line arguments to ``parser`` and return it: ``--deepspeed``
    (a flag for the script's own use), ``--deepspeed_config FILE`` (read by
    ``initialize(args=...)``), and the deprecated ``--deepscale``/``--deepscale_config``.

    Like DeepSpeed's, it adds no ``--local_rank``: scripts that read one declare it
    themselves (zero-launch passes it to those that do)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (a flag for user code; no effect on the engine)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
