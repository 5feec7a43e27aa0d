"""How a communicator behaves: chosen once, at ``zero_comm.init``, and inherited by every
subgroup split from it (see :func:`zero_comm.init` for what each option means)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .call_check import check_mode

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CommOptions:
    """``deterministic``: float sums in rank order; ``check_consistency``: compare calls
    across ranks (True/"every", "digest", False/"off"); ``timeout``: seconds a rendezvous
    or collective waits for its peers."""

    deterministic: bool = False
    check_consistency: bool | str = "digest"
    timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout, int | float) and math.isfinite(self.timeout)) or (
            self.timeout <= 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        check_mode(self.check_consistency)  # raises, naming the accepted values
