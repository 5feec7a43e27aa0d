"""Real processes: the topology init finds, its override, and the node subgroups.

Four ranks on one host, started with ZERO_RANKS_PER_NODE=2: init must see two nodes of two
(the variable wins), the launcher's variables and (mpi) the shared-memory split one node.
"""

from __future__ import annotations

import pytest
import topology_bodies

from zero_comm.testing import find_mpiexec, run_on_ranks

needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None, reason="no mpiexec: pip install mpich mpi4py (nox -s tests_mpi does)"
)


@pytest.mark.parametrize(
    ("backend", "launcher"),
    [
        pytest.param("mpi", "mpiexec", marks=[pytest.mark.mpi, needs_mpi], id="mpi-mpiexec-4"),
        # The same on gloo costs another four processes; the simulated tests cover its logic.
        pytest.param("gloo", "spawn", marks=[pytest.mark.gloo, pytest.mark.slow],
                     id="gloo-spawn-4"),
    ],
)  # fmt: skip
def test_detected_and_overridden_topology_on_four_ranks(
    backend: str, launcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZERO_RANKS_PER_NODE", "2")
    reports = run_on_ranks(
        topology_bodies.topology_on_real_ranks, 4, backend=backend, launcher=launcher,
        timeout=180,
    )  # fmt: skip
    one_node = [0, 0, 0, 0]
    for rank, report in enumerate(reports):
        found = report["value"]
        assert found["init"] == [[0, 0, 1, 1], "ZERO_RANKS_PER_NODE"]
        # mpiexec: MPICH's (or Open MPI's) local ranks; zero-launch: torchrun's variables.
        assert found["launcher"][0] == one_node
        assert found["launcher"][1] in (("mpich", "openmpi") if backend == "mpi" else ("torchrun",))
        if backend == "mpi":
            assert found["bare"] == [one_node, "mpi-shared-memory"]
            assert found["shared_memory_key"] == 0
        else:
            assert found["bare"] == [one_node, "hostname"]
        node = rank // 2
        intra, inter = [2 * node, 2 * node + 1], [rank % 2, rank % 2 + 2]
        assert found["groups"] == [intra, inter]
        assert found["sums"] == [float(sum(intra)), float(sum(inter)), 6.0]
        # One float all_reduced on 2 x 2: 2 * 3/4 * 4 bytes = 6, across nodes from ranks 1, 3.
        assert found["world_all_reduce_bytes"] == (["0", "6"] if rank % 2 else ["6", "0"])
