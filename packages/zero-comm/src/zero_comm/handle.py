"""What an asynchronous collective returns: :class:`Handle`, over a backend's :class:`Work`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .profiler_ranges import profiler_range, profiling


class Work(Protocol):
    """An operation in flight; ``wait()`` blocks until it has completed."""

    def wait(self) -> Any: ...


class HandleOwner(Protocol):
    """What a handle needs of its communicator: the queue of handles whose completion
    issues another collective, run in issue order, and the backend's wait."""

    _pending: deque[Handle]

    def _run_pending(self, until: Handle | None = None) -> None: ...

    def _wait(self, work: Work, name: str) -> None: ...


class CompletedWork:
    """A :class:`Work` that is already done (world size 1, empty tensors, simulations)."""

    def wait(self) -> None:
        return None


class Handle:
    """What an ``async_op=True`` collective returns; ``wait()`` completes it.

    The result is in the output tensor only after ``wait()`` returns. For rank-ordered
    reductions the local fold (and, for all_reduce, the all-gather that follows it) runs
    inside ``wait()``. Waiting twice is harmless.

    A handle whose completion issues another collective (the ordered all-reduce's gather
    phase) is queued on the communicator, and queued phases run strictly in issue order: at
    the ``wait()`` of that handle or of a later one, or at the next collective, whichever
    comes first. So ranks may wait in any order, as with torch.distributed, and every rank
    still issues the same sequence of collectives.
    """

    def __init__(
        self, comm: HandleOwner, name: str, work: Work, finish: Callable[[], None] | None = None
    ) -> None:
        self._comm = comm
        self._name = name
        self._work = work
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self in self._comm._pending:
            self._comm._run_pending(until=self)
            return
        self._complete_now()

    def _complete_now(self) -> None:
        # One range per wait on a trace: zero::all_gather.wait, ... (profiler_ranges);
        # tested here rather than entering a no-op range: the hot path of every collective.
        if profiling():
            with profiler_range(self._name, ".wait"):
                self._complete()
        else:
            self._complete()

    def _complete(self) -> None:
        if not isinstance(self._work, CompletedWork):
            self._comm._wait(self._work, self._name)
        self._done = True
        if self._finish is not None:
            self._finish()

    def is_completed(self) -> bool:
        return self._done
