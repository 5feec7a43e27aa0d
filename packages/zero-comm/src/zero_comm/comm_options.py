"""How a communicator behaves: chosen once, at ``zero_comm.init``, and inherited by every
subgroup split from it (see :func:`zero_comm.init` for what each option means)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .call_check import check_mode

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CommOptions:
    """``deterministic``: float sums in rank order; ``check_consistency``: compare calls
    across ranks (True/"every", "digest", False/"off"); ``timeout``: seconds a rendezvous
    or collective waits for its peers; ``heartbeat_timeout``: seconds without a heartbeat
    after which a peer that a collective waits on is named as stuck (zero_comm.heartbeat)."""

    deterministic: bool = False
    check_consistency: bool | str = "digest"
    timeout: float = DEFAULT_TIMEOUT_S
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        check_mode(self.check_consistency)  # raises, naming the accepted values
