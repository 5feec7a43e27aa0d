"""The ``digest`` consistency check: collectives compared across ranks only when new.

The ``every`` check all-gathers each call's description before its data moves: exact, but
one small collective per call (1.2x a stage-3 step on gloo here). Training repeats itself,
so ``digest`` keeps, on every rank, the calls already agreed on, keyed by a digest of the
calls just before them::

    context = hash(last WINDOW agreed calls)       identical on every rank, by induction
    schedule[context] = the call agreed next

A call that its rank's schedule predicts goes ahead with no communication. Any other call
(a new context: the first step; or a call the schedule did not predict) is *resolved*: its
rank posts it out of band (a channel of the backend's own that no data collective can
pair with) and collects every rank's call for that sequence number. Ranks whose call
*was* predicted are already inside the data collective, which cannot complete without the
resolving rank; while they wait they look for posts, and on finding one post their own
call and collect too. So a divergence is always resolved by every rank before any
mismatched data moves, and each raises :class:`CollectiveMismatchError` naming every
rank's call. Because every rank holds the same schedule, either all ranks or none find a
call predicted when the calls agree: resolutions of agreeing calls involve every rank.

Backends provide the channel (Communicator._post_call / _posted_call / _collect_calls):
the rendezvous store for gloo and nccl, a duplicate communicator for MPI, shared memory for
the simulated backend.
"""

from __future__ import annotations

from collections import OrderedDict, deque

Call = tuple[int, ...]  # (collective, dtype, numel, op, root, label): see communicator.py

WINDOW = 8  # calls of context: long enough that a step's calls rarely share one
LIMIT = 1 << 14  # schedule entries kept (a few MB); a program whose calls never repeat starts over
RECENT = 64  # predicted calls remembered, for joining a resolution that names one


class CallSchedule:
    """What this rank has agreed with every other rank so far (see the module docstring)."""

    def __init__(self) -> None:
        self._window: deque[Call] = deque(maxlen=WINDOW)
        self._next: dict[int, Call] = {}
        self.predicted: OrderedDict[int, tuple[str, Call]] = OrderedDict()

    def _context(self) -> int:
        return hash(tuple(self._window))

    def predicts(self, call: Call) -> bool:
        return self._next.get(self._context()) == call

    def prediction(self) -> Call | None:
        """The call agreed next in this context before, if any."""
        return self._next.get(self._context())

    def go_ahead(self, sequence: int, name: str, call: Call) -> None:
        """``call`` (number ``sequence``) was predicted and goes ahead unchecked."""
        self._window.append(call)
        self.predicted[sequence] = (name, call)
        while len(self.predicted) > RECENT:
            self.predicted.popitem(last=False)

    def agreed(self, call: Call) -> None:
        """Every rank resolved ``call`` alike: predict it in this context from now on."""
        if len(self._next) >= LIMIT:
            self._next.clear()
        self._next[self._context()] = call
        self._window.append(call)
