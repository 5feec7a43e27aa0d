"""The communicator ZeroTrainer trains over: the process group Accelerate already made."""

from __future__ import annotations

import zero_comm


def adopted_communicator(num_processes: int) -> zero_comm.Communicator:
    """A deterministic communicator over the ``num_processes`` processes that Accelerate
    (the Trainer's ``PartialState``) has set up.

    With several, Accelerate has initialised the default process group (gloo on CPU, nccl
    on CUDA): it is adopted (zero_comm.from_process_group), never a second world. With one,
    Accelerate makes no group; zero_comm.init adopts one if a launcher made it, else makes
    the single-rank world."""
    if num_processes > 1:
        return zero_comm.from_process_group(None, deterministic=True)
    return zero_comm.init(deterministic=True)
