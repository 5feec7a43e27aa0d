"""Testing kit: simulated worlds, a multi-process harness, and the collective properties.

Users can run the same checks on their own cluster, e.g. that their MPI gives bit-exact
deterministic reductions:

    mpiexec -n 4 python -m mpi4py -m zero_comm.testing.selfcheck
"""

from .harness import LAUNCHERS, RanksFailed, find_mpiexec, is_open_mpi, run_on_ranks

__all__ = ["LAUNCHERS", "RanksFailed", "find_mpiexec", "is_open_mpi", "run_on_ranks"]
