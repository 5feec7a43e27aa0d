"""Temporary: the communicator over the process group Lightning initialised, until
zero_comm.from_process_group (branch adopt) is merged; then this file goes."""

from __future__ import annotations

import os

import zero_comm


def adopt_world(
    rank: int, world_size: int, local_rank: int, local_world_size: int
) -> zero_comm.Communicator:
    """zero_comm.init over the initialised default group (it reuses a group that exists),
    with the launcher variables it reads set from Lightning's cluster environment."""
    for name, value in (
        ("RANK", rank),
        ("WORLD_SIZE", world_size),
        ("LOCAL_RANK", local_rank),
        ("LOCAL_WORLD_SIZE", local_world_size),
    ):
        os.environ.setdefault(name, str(value))
    return zero_comm.init("auto", deterministic=True)
