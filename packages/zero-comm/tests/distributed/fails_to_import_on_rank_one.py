"""A body file that fails while rank 1 imports it: that rank never initialises."""

from zero_comm import Communicator
from zero_comm.launcher_env import detect_launch_env

# Whatever started the ranks (torchrun's RANK, MPICH's PMI_RANK, Open MPI's
# OMPI_COMM_WORLD_RANK, SLURM): reading only some of them let rank 1 import fine under
# Open MPI, and the test passed nothing.
if detect_launch_env().rank == 1:
    raise ImportError("deliberate import failure on rank 1")


def body(comm: Communicator) -> None:
    comm.barrier()
