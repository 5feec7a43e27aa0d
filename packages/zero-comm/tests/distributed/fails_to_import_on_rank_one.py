"""A body file that fails while rank 1 imports it: that rank never initialises."""

import os

from zero_comm import Communicator

if os.environ.get("RANK", os.environ.get("PMI_RANK")) == "1":
    raise ImportError("deliberate import failure on rank 1")


def body(comm: Communicator) -> None:
    comm.barrier()
