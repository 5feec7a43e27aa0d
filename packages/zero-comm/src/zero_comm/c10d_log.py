"""torch's C++ warnings, raised to errors only, where zero_comm names a failure itself.

When the rank that hosts the rendezvous store (rank 0) dies, every store operation of a
survivor fails, and torch's c10d first writes each failure to stderr as a C++ warning with
its stack: 16-43 lines of "recvValue failed ... Connection reset by peer" and "frame #N"
that bury the one line zero_comm prints about it (a PeerFailureError naming rank 0 and its
store). A timed-out store wait writes two more ("waitForInput ... timed out").

c10 reads its log level (``TORCH_CPP_LOG_LEVEL``) once, as ``import torch`` loads it, which
comes before ``zero_comm.init``; so this sets the level's variable in libc10 itself, to
ERROR (2), as ``TORCH_CPP_LOG_LEVEL=ERROR`` would have. It is c10's glog-style log only:
torch's Python-visible warnings (``TORCH_WARN``) go through Python's warnings and are not
touched, nor are errors. A ``TORCH_CPP_LOG_LEVEL`` the user set is left as it is, and
where the variable cannot be found (another torch build) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_LEVEL_SYMBOL = "FLAGS_caffe2_log_level"


def quiet_cpp_warnings() -> bool:
    """Raise c10's C++ log level to ERROR unless ``TORCH_CPP_LOG_LEVEL`` is set; whether
    the level is ERROR or above now."""
    if os.environ.get("TORCH_CPP_LOG_LEVEL"):
        return False
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        level = ctypes.c_int.in_dll(library, _LEVEL_SYMBOL)
    except (OSError, ValueError) as exc:
        log.debug("zero_comm: c10's log level not found (%s); torch's C++ warnings stay", exc)
        return False
    level.value = max(level.value, _ERROR)
    return True
