"""``detect_topology``: which ranks of a world communicator share a node.

Its own module because both ways to get a world need it: ``world.init`` (zero_comm makes
the world) and ``adopt`` (a framework made it), and ``world`` calls into ``adopt``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from .communicator import Communicator
from .errors import LaunchEnvError
from .launcher_env import node_key_from_env
from .topology import NodeEvidence, Topology, topology_from_evidence

log = logging.getLogger("zero_comm.world")


def detect_topology(
    comm: Communicator,
    *,
    ranks_per_node: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """Collective unless ``ranks_per_node`` is given: which ranks of ``comm`` share a node.

    In order, the first that applies: ``ranks_per_node``; ZERO_RANKS_PER_NODE; the
    launcher's variables (torchrun, Open MPI, MPICH / Intel MPI, SLURM); under the mpi
    backend, a shared-memory split; the host name. Every rank's answer is all-gathered
    and the choice is made alike on every rank (zero_comm.topology). ``comm`` is a world
    communicator: the launcher's variables describe the world's ranks (a subgroup inherits
    its topology at ``split`` instead). ``environ`` stands for ``os.environ`` (tests).
    """
    if ranks_per_node is not None:
        try:
            return Topology.uniform(comm.world_size, ranks_per_node)
        except ValueError as exc:
            raise ValueError(f"[rank {comm.rank}] ranks_per_node: {exc}") from None
    env = os.environ if environ is None else environ
    shared_memory = None
    if comm.backend == "mpi" and comm.world_size > 1:
        from .mpi_backend import MPICommunicator

        if isinstance(comm, MPICommunicator):
            shared_memory = comm.shared_memory_node_key()
    try:
        launcher = node_key_from_env(env)
    except LaunchEnvError as exc:
        # Not raised here alone: the other ranks would wait in the gather below for ever.
        log.warning("zero_comm: [rank %d] %s; finding the nodes another way", comm.rank, exc)
        launcher = None
    mine = NodeEvidence(
        env.get("ZERO_RANKS_PER_NODE") or None, launcher, shared_memory, socket.gethostname()
    )
    everyone = [mine] if comm.world_size == 1 else comm.all_gather_object(mine)
    try:
        return topology_from_evidence(everyone)
    except ValueError as exc:
        raise ValueError(f"[rank {comm.rank}] {exc}") from None
