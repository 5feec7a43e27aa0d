"""Rank bodies of test_topology_ranks.py (see zero_comm.testing.harness)."""

from __future__ import annotations

import os
from typing import Any

import torch

from zero_comm import Communicator
from zero_comm.world import detect_topology


def topology_on_real_ranks(comm: Communicator) -> dict[str, Any]:
    """Started with ZERO_RANKS_PER_NODE=2: what init found, and what detection finds
    without that variable (the launcher's), and without any variable (under the mpi
    backend the shared-memory split, else the host name); the node subgroups at work."""
    found: dict[str, Any] = {"init": (list(comm.topology.node_of), comm.topology.source)}
    unset = {k: v for k, v in os.environ.items() if k != "ZERO_RANKS_PER_NODE"}
    for name, environ in (("launcher", unset), ("bare", {})):
        topo = detect_topology(comm, environ=environ)
        found[name] = (list(topo.node_of), topo.source)
    if comm.backend == "mpi":
        found["shared_memory_key"] = comm.shared_memory_node_key()  # type: ignore[attr-defined]
    sums = []
    for group in (comm.intra_node(), comm.inter_node(), comm):
        x = torch.tensor([float(comm.rank)])
        group.all_reduce(x)
        sums.append(x.item())
    found["sums"] = sums
    found["groups"] = [comm.intra_node().parent_ranks, comm.inter_node().parent_ranks]
    found["world_all_reduce_bytes"] = [
        str(comm.stats["all_reduce"].intra_node_bytes),
        str(comm.stats["all_reduce"].inter_node_bytes),
    ]
    return found
