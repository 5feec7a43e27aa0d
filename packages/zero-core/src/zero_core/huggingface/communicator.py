"""The communicator ZeroTrainer trains over: the process group Accelerate already made."""

from __future__ import annotations

import zero_comm


def adopted_communicator(num_processes: int) -> zero_comm.Communicator:
    """A deterministic communicator over the world of ``num_processes`` processes that
    Accelerate (the Trainer's ``PartialState``) has set up: with one process, zero_comm's
    own single-rank world (Accelerate makes no process group then)."""
    # zero_comm.init makes the single-rank world, or reuses the default group Accelerate
    # initialised when its backend is the one "auto" picks (nccl on CUDA, else gloo; as
    # Accelerate picks). TODO: zero_comm.from_process_group() once it lands (issue 47).
    del num_processes
    return zero_comm.init(deterministic=True)
