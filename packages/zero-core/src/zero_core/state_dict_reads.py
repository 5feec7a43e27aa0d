"""Whether the engine itself is reading a module's ``state_dict()`` (on this thread).

At stage 3, ``state_dict()`` of a module with released parameters raises
(module_guard.guard_state_dict): their tensors read NaN. The engine's own
``full_state_dict`` takes the names and the frozen values from ``state_dict()`` and the
trained values from its master weights, so it reads inside :func:`engine_reads`.
(A module of its own: the engine imports it, and the guard, which knows the engines'
parameters, must not be imported by the engine.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_STATE = threading.local()


@contextmanager
def engine_reads() -> Iterator[None]:
    """Inside, ``by_engine()`` is True on this thread."""
    _STATE.active = True
    try:
        yield
    finally:
        _STATE.active = False


def by_engine() -> bool:
    return bool(getattr(_STATE, "active", False))
