"""torch's flight recorder is off in a process whose world zero_comm creates, unless the
user set its size.

The recorder is one per process, sized from the environment when it first records, so the
setting is process-wide: it holds for every process group of this process (the user's
own included) and for children that inherit its environment. Where torch.distributed was
initialised before ``zero_comm.init``, zero_comm leaves the environment alone: the
recorder may already be sized.

c10d's flight recorder keeps a ring of the last collectives (2000 by default, for the dump
a hung NCCL job can write). Each entry it records holds small heap blocks (41 bytes and
the like, allocated in ``ProcessGroupGloo::enqueue``) that live until the ring wraps
around. A stage-3 step issues hundreds of collectives, between activations that glibc
serves from its heap (blocks under its mmap threshold, 1 MiB in the largest-model
search). Each long-lived entry then sits at the edge of a freed activation, and the next
step's activation of the same size, 64-byte aligned (``posix_memalign``), no longer fits
the hole it left, so the heap grows at its top instead:

    step k:    [act 512K][entry][act 512K][entry] ...      entries live for ~2000 calls
    step k+1:  [ hole  ][entry][ hole  ][entry] ... [act 512K][entry][act 512K] ...
                 512K + 16 bytes: too small for 512K + alignment

At 24 layers of width 1024 on 4 ranks with every block checkpointed, glibc's heap grew
35-40 MiB a step with this recorder on and stayed flat without it (docs/stage3-memory.md).
It showed on communicators split from the world (as the benchmark's and a tensor x data
mesh's are): in tests/test_heap_growth.py's run the free heap grew 70 MiB in 6 steps on
a split communicator (3 MiB with the recorder off), and on the world group 10 MiB (6
off). The blocks were attributed to the recorder by turning it off, which removed the
growth; the malloc trace was not repeated without it.
zero_comm names a dead or diverging rank itself (``check_consistency``, the host watch),
so the recorder's dump is not what finds a hang here. A user who wants it sets
``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) before
``zero_comm.init``, and that setting is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# torch reads the first of these that is set; either one set by the user is kept.
RECORDER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def keep_flight_recorder_off(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``TORCH_FR_BUFFER_SIZE=0`` in ``environ`` (this process's environment by
    default) unless a recorder size is set there already; True if this call set it.

    Call it before the first process group records a collective: torch reads the size once,
    when its recorder is first used."""
    env = os.environ if environ is None else environ
    if any(name in env for name in RECORDER_SIZE_VARIABLES):
        return False
    env[RECORDER_SIZE_VARIABLES[0]] = "0"
    return True
