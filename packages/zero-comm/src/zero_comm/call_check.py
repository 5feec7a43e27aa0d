"""How ranks agree on each collective call before its data moves.

Each call is described by a row of integers, the same on every rank of a correct program::

    (collective, dtype, numel, op, root, label)     label: crc32 of the caller's string

and ``check_consistency`` chooses how rows are compared across ranks:

    "every"  (True)   an all-gather of the row before each call: exact, one small
                      collective per call
    "digest"          only rows not agreed before in the same place, out of band
                      (call_schedule.py): nothing, once a training loop is learned
    "off"    (False)  no comparison

A disagreement raises :class:`CollectiveMismatchError` on every rank naming each rank's
call. :class:`CallCheck` is the part of :class:`~zero_comm.communicator.Communicator` that
does this; backends supply the digest check's out-of-band channel.
"""

from __future__ import annotations

import abc
import zlib
from typing import Any

import torch

from .call_schedule import CallSchedule
from .errors import CollectiveMismatchError, CommTimeoutError
from .reduce_op import ReduceOp

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
)
DTYPE_CODE = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES)}
COLLECTIVE_CODE = {
    "all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "barrier": 5,
    "split": 6, "broadcast_object": 7, "all_gather_object": 8, "all_to_all": 9,
    "all_reduce_rows": 10, "reduce_scatter_rows": 11,
}  # fmt: skip
INVALID_CALL = -1  # a rank whose own arguments were bad sends this as its collective code
CODE_COLLECTIVE = {code: name for name, code in COLLECTIVE_CODE.items()}
# Labels travel as a 32-bit code; every label a process has used is remembered here so an
# error can print another rank's label (ranks label the same things with the same strings).
_LABELS: dict[int, str] = {}


CHECK_MODES = ("every", "digest", "off")


def check_mode(check_consistency: bool | str) -> str:
    """``check_consistency`` as one of CHECK_MODES (True is "every", False is "off")."""
    if check_consistency is True:
        return "every"
    if check_consistency is False:
        return "off"
    if check_consistency not in CHECK_MODES:
        raise ValueError(
            f"check_consistency={check_consistency!r}: use True or 'every' (compare each call "
            "before its data moves), 'digest' (compare only calls not seen before in that "
            "place; nearly free in a training loop), or False / 'off'"
        )
    return str(check_consistency)


def label_code(label: str) -> int:
    if not label:
        return 0
    code = zlib.crc32(label.encode()) + 1
    _LABELS[code] = label
    return code


def describe_call(row: list[int]) -> str:
    collective, dtype_code, numel, op, root, label = row
    name = CODE_COLLECTIVE.get(collective, f"collective#{collective}")
    parts = []
    if 0 <= dtype_code < len(SUPPORTED_DTYPES):
        parts += [str(SUPPORTED_DTYPES[dtype_code]).removeprefix("torch."), f"numel={numel}"]
    if op in {o.value for o in ReduceOp}:
        parts.append(ReduceOp(op).name)
    if root >= 0 and name.endswith("_rows"):
        parts.append(f"row_counts#{root:x}")  # row_collectives.row_counts_code
    elif root >= 0:
        parts.append(f"src={root}")
    if label:
        parts.append(repr(_LABELS.get(label, f"label#{label:x}")))
    return f"{name}({', '.join(parts)})"


class CallCheck(abc.ABC):
    """The agreement on each call (a base of Communicator; see the module docstring)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    _sequence: int

    @abc.abstractmethod
    def _err(self, message: str) -> str: ...

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any: ...

    @abc.abstractmethod
    def _wait(self, work: Any, name: str) -> None: ...

    def _init_call_check(self, check_consistency: bool | str) -> None:
        self.check_consistency = check_consistency
        self._schedule = CallSchedule()
        self._resolving = False
        self._diverged: str | None = None  # the collective at which a digest check failed
        # Calls this rank compared with the other ranks' (every call with "every"; with
        # "digest" only the calls its schedule did not predict, and those others resolved).
        self.compared_calls = 0

    @property
    def check_consistency(self) -> bool | str:
        return self._check_consistency

    @check_consistency.setter
    def check_consistency(self, value: bool | str) -> None:
        self._check_mode = check_mode(value)
        self._check_consistency = value

    def _check_not_diverged(self, name: str) -> None:
        if self._diverged is not None:
            raise CollectiveMismatchError(
                self._err(
                    f"{name}: this communicator stopped at the divergence of {self._diverged}: "
                    "ranks that went ahead with that collective still have it in flight, so "
                    "nothing more can be exchanged on it. Fix the divergence and restart."
                )
            )

    def _agree(self, name: str, row: list[int], error: Exception | None) -> None:
        """Compare this rank's ``row`` for the call just entered (number ``_sequence``) as
        the mode says; raise ``error`` (this rank's own bad arguments) after taking part,
        or CollectiveMismatchError if the ranks disagree."""
        if self._check_mode == "off" or self.world_size == 1:
            if error is not None:
                raise error
            return
        if self._check_mode == "digest":
            call = tuple(row)
            if error is None and self._schedule.predicts(call):
                self._schedule.go_ahead(self._sequence, name, call)
                return
            predicted = self._schedule.prediction()
            rows = self._resolve_unpredicted(name, call)
            if predicted is not None and list(predicted) in rows:
                # Some ranks went ahead with the predicted collective: after the error
                # below this communicator is unusable (see _check_not_diverged).
                self._diverged = f"{name} #{self._sequence}"
            if error is not None:
                raise error
            self._judge(name, self._sequence, rows)
            self._schedule.agreed(call)
            return
        self.compared_calls += 1
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world_size * len(row), dtype=torch.int64, device=self.device)
        self._wait(
            self._all_gather(everyone, mine), f"{name} #{self._sequence} (consistency check)"
        )
        if error is not None:
            raise error
        self._judge(name, self._sequence, everyone.view(self.world_size, -1).tolist())
        self._schedule.agreed(tuple(row))  # so that switching to "digest" starts informed

    def _judge(self, name: str, sequence: int, rows: list[list[int]]) -> None:
        """Raise :class:`CollectiveMismatchError` unless every rank's call ``rows[r]`` of
        collective number ``sequence`` is the same valid call."""
        invalid = [r for r, other in enumerate(rows) if other[0] == INVALID_CALL]
        if invalid:
            raise CollectiveMismatchError(
                self._err(
                    f"{name} #{sequence}: ranks {invalid} passed invalid arguments (see "
                    "their errors); this rank stops too, so that no rank waits for them"
                )
            )
        if all(other == rows[0] for other in rows):
            return
        seen = "; ".join(f"rank {r}: {describe_call(other)}" for r, other in enumerate(rows))
        raise CollectiveMismatchError(
            self._err(
                f"{name} #{sequence}: ranks disagree on the collective: {seen}. Every "
                "rank must call the same collectives in the same order, with the same numel, "
                "dtype, op, root and label."
            )
        )

    # ------------------------------------------------ the digest check's channel
    def _resolve(self, name: str, sequence: int, call: tuple[int, ...]) -> list[list[int]]:
        """Post this rank's call number ``sequence`` out of band and collect every rank's."""
        self._resolving = True
        self.compared_calls += 1
        try:
            self._post_call(sequence, call)
            return self._collect_calls(sequence, call, f"{name} #{sequence} (digest check)")
        finally:
            self._resolving = False

    def _resolve_unpredicted(self, name: str, call: tuple[int, ...]) -> list[list[int]]:
        """Resolve this rank's call, which its schedule did not predict. If the others never
        join (a backend whose waits cannot look for posts, such as nccl), the schedule still
        says what they are most likely calling."""
        predicted = self._schedule.prediction()
        try:
            return self._resolve(name, self._sequence, call)
        except CommTimeoutError as exc:
            if predicted is None:
                raise
            raise CollectiveMismatchError(
                self._err(
                    f"{name} #{self._sequence}: this rank called {describe_call(list(call))} "
                    f"where every rank agreed before on {describe_call(list(predicted))}, "
                    "and the others did not compare their calls within the timeout (they are "
                    "most likely in that one). Every rank must call the same collectives in "
                    "the same order."
                )
            ) from exc

    def _join_resolution(self) -> None:
        """Called by the backends while a collective waits (digest check): if another rank
        is resolving a call this rank went ahead with, resolve it too (and raise: that
        call was predicted here, so it cannot agree with one predicted nowhere)."""
        if self._resolving or self._check_mode != "digest":
            return
        sequence = self._posted_call()
        if sequence is None or sequence not in self._schedule.predicted:
            return  # none, or one this rank has not reached yet: it will wait there
        name, call = self._schedule.predicted.pop(sequence)
        rows = self._resolve(name, sequence, call)
        try:
            self._judge(name, sequence, rows)
        except CollectiveMismatchError:
            self._diverged = f"{name} #{sequence}"  # this rank went ahead: still in flight
            raise

    def _post_call(self, sequence: int, call: tuple[int, ...]) -> None:
        raise NotImplementedError(f"the {self.backend} backend has no digest check")

    def _posted_call(self) -> int | None:
        """The sequence number of a call another rank has posted and this rank has not
        collected yet (None if there is none)."""
        return None

    def _collect_calls(self, sequence: int, call: tuple[int, ...], what: str) -> list[list[int]]:
        """Every rank's call number ``sequence`` (this rank's is ``call``), once all have
        posted it; CommTimeoutError about ``what``, naming the ranks that did not post
        within the timeout."""
        raise NotImplementedError(f"the {self.backend} backend has no digest check")
