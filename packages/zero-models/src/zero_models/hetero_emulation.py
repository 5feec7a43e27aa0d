"""Slower hardware, emulated without changing a bit (--emulate-micro-batch-seconds).

Each micro-batch slot's forward and backward on a rank is padded with a sleep to a fixed
duration, so a 2:1 speed mix on one machine is two ranks whose slots last 0.2 s and
0.4 s. The computation itself is untouched (threads per rank are part of the bits'
fingerprint, so slowing a rank by taking threads away would change them); a slot that
already takes longer than its duration is not shortened, and is counted in ``overruns``.

    padding = SlotPadding(0.4)
    with padding:
        loss = loss_fn(engine(x)); engine.backward(loss)   # then sleeps to 0.4 s
"""

from __future__ import annotations

import time
from types import TracebackType


class SlotPadding:
    """A context manager that makes its block last at least ``seconds`` (None: no
    padding, a no-op). ``overruns`` counts blocks that took longer on their own."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"padded seconds per micro-batch {seconds!r} must be > 0")
        self.seconds = seconds
        self.overruns = 0
        self._start = 0.0

    def __enter__(self) -> SlotPadding:
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.seconds is None or kind is not None:
            return
        left = self.seconds - (time.perf_counter() - self._start)
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
