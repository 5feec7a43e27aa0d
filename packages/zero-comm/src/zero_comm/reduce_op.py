"""The reduction operations a communicator supports."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Elementwise reduction across ranks.

    ``AVG`` is ``SUM`` followed by one division by the world size, in the tensor's dtype,
    so that it is deterministic whenever ``SUM`` is. ``MAX`` and ``MIN`` do not depend on
    the order of their operands and are exact on every backend.
    """

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3
