"""The :class:`Communicator` interface, and what every backend shares.

A backend implements five primitives that move bytes without reducing them, or that
reduce in the backend's own order:

    _all_to_all(out, inp)        rank r receives chunk r of every rank's inp, in rank order
    _all_gather(out, inp)        out = concat(inp of rank 0, ..., inp of rank N-1)
    _broadcast(tensor, src)
    _all_reduce_native(t, op)    op in SUM, MAX, MIN; order chosen by the backend
    _reduce_scatter_native(out, inp, op)

and this class builds the public collectives from them: argument checks, the cross-rank
consistency check, the statistics, the rank-ordered (deterministic) reductions, AVG, and
the asynchronous handles. All tensors are flat and contiguous on ``self.device``.

Which reduction is used:

    op / dtype                 deterministic=True     deterministic=False
    MAX, MIN, integer SUM      native (exact anyway)  native
    float SUM, AVG             rank-ordered           native

unless the backend prefers the rank-ordered algorithm for that collective and dtype
(``_prefers_ordered``: where it is faster, or where the backend has no native reduction).
"""

from __future__ import annotations

import abc
import pickle
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .buffers import BufferPool
from .call_schedule import CallSchedule
from .errors import CollectiveMismatchError, CommError, CommTimeoutError
from .ordered import chunk_numel, fold_rows
from .peers import Peer
from .reduce_op import ReduceOp
from .stats import CommStats

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
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES)}
_COLLECTIVE_CODE = {
    "all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "barrier": 5,
    "split": 6, "broadcast_object": 7, "all_gather_object": 8,
}  # fmt: skip
_INVALID = -1  # a rank whose own arguments were bad sends this as its collective code
_CODE_COLLECTIVE = {code: name for name, code in _COLLECTIVE_CODE.items()}
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


def _label_code(label: str) -> int:
    if not label:
        return 0
    code = zlib.crc32(label.encode()) + 1
    _LABELS[code] = label
    return code


class Work(Protocol):
    """An operation in flight; ``wait()`` blocks until it has completed."""

    def wait(self) -> Any: ...


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
        self, comm: Communicator, name: str, work: Work, finish: Callable[[], None] | None = None
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
        if not isinstance(self._work, CompletedWork):
            self._comm._wait(self._work, self._name)
        self._done = True
        if self._finish is not None:
            self._finish()

    def is_completed(self) -> bool:
        return self._done


class Communicator(abc.ABC):
    """A group of ``world_size`` ranks and the collectives among them.

    Attributes:
        rank: this process's index in the group, 0..world_size-1.
        world_size: the number of ranks.
        backend: "gloo", "nccl", "mpi" or "simulated".
        device: where tensors passed to collectives must live.
        deterministic: every float SUM/AVG adds contributions in rank order.
        check_consistency: ranks compare each collective's (collective, dtype, numel, op,
            root, label) and all raise :class:`CollectiveMismatchError` if any differ, before
            its data moves. True / "every": one small all-gather per call. "digest": only
            calls not agreed before in the same place are compared, out of band
            (call_schedule.py); a training loop's steps after the first cost nothing.
            False / "off": no check.
        timeout: seconds a collective may wait for its peers.
        stats: calls and ring-convention volume per collective.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        deterministic: bool,
        check_consistency: bool | str,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.deterministic = deterministic
        self.check_consistency = check_consistency
        self._schedule = CallSchedule()
        self._resolving = False
        self._diverged: str | None = None  # the collective at which a digest check failed
        # Calls this rank compared with the other ranks' (every call with "every"; with
        # "digest" only the calls its schedule did not predict, and those others resolved).
        self.compared_calls = 0
        self.timeout = timeout
        self.stats = CommStats(world_size)
        self.buffers = BufferPool(device)
        self._sequence = 0
        self.closed = False
        self._pending: deque[Handle] = deque()
        # (host, pid) of every rank, where the backend knows them (see peers.py).
        self.peers: list[Peer] | None = None

    @property
    def check_consistency(self) -> bool | str:
        return self._check_consistency

    @check_consistency.setter
    def check_consistency(self, value: bool | str) -> None:
        self._check_mode = check_mode(value)
        self._check_consistency = value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size}, deterministic={self.deterministic})"
        )

    # ----------------------------------------------------------------- primitives
    @abc.abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...

    @abc.abstractmethod
    def _all_reduce_native(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter_native(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp
    ) -> Work: ...

    @abc.abstractmethod
    def _barrier(self) -> Work: ...

    @abc.abstractmethod
    def _split(self, color: int, key: int) -> Communicator: ...

    @abc.abstractmethod
    def _wait(self, work: Work, name: str) -> None:
        """Wait for ``work``, turning the backend's failures into :class:`CommError`."""

    def _prefers_ordered(self, collective: str, dtype: torch.dtype) -> bool:
        """Whether the rank-ordered algorithm is used even when not asked to be deterministic.

        Backends override this where the ordered algorithm is the faster one, or the only
        correct one (MPI has no bfloat16 type to reduce natively).
        """
        return False

    def close(self) -> None:
        """Release the backend's resources; the communicator cannot be used afterwards."""
        self.closed = True
        self.buffers.clear()

    # ------------------------------------------------------------------ checks
    def _err(self, message: str) -> str:
        return f"[rank {self.rank}] {message}"

    def _check_open(self, name: str) -> None:
        if self.closed:
            raise CommError(self._err(f"{name}: this communicator was closed; create a new one"))
        if self._diverged is not None:
            raise CollectiveMismatchError(
                self._err(
                    f"{name}: this communicator stopped at the divergence of {self._diverged}: "
                    "ranks that went ahead with that collective still have it in flight, so "
                    "nothing more can be exchanged on it. Fix the divergence and restart."
                )
            )

    def _check_tensor(self, name: str, role: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(self._err(f"{name}: {role} must be a torch.Tensor, got {type(tensor)}"))
        if tensor.dtype not in _DTYPE_CODE:
            supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(
                self._err(f"{name}: {role} has dtype {tensor.dtype}; supported: {supported}")
            )
        if tensor.device.type != self.device.type:
            raise ValueError(
                self._err(
                    f"{name}: {role} is on {tensor.device} but this {self.backend} communicator "
                    f"works on {self.device}; move it with .to({str(self.device)!r})"
                )
            )
        if not tensor.is_contiguous():
            raise ValueError(
                self._err(f"{name}: {role} must be contiguous; pass tensor.contiguous()")
            )

    def _check_src(self, name: str, src: int) -> int:
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(
                self._err(
                    f"{name}: src={src!r} is not a rank of this group (0..{self.world_size - 1})"
                )
            )
        return src

    def _check_op(self, name: str, op: ReduceOp, dtype: torch.dtype) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(self._err(f"{name}: op must be a zero_comm.ReduceOp, got {op!r}"))
        if op is ReduceOp.AVG and not dtype.is_floating_point:
            raise TypeError(
                self._err(f"{name}: AVG of {dtype} would truncate; use SUM and divide yourself")
            )

    def _check_pair(
        self, name: str, out: torch.Tensor, inp: torch.Tensor, out_factor: int, in_factor: int
    ) -> None:
        self._check_tensor(name, "output", out)
        self._check_tensor(name, "input", inp)
        if out.dtype != inp.dtype:
            raise TypeError(
                self._err(
                    f"{name}: output is {out.dtype} but input is {inp.dtype}; they must match"
                )
            )
        if in_factor > 1 and inp.numel() % in_factor:
            raise ValueError(
                self._err(
                    f"{name}: the input's {inp.numel()} elements do not split into "
                    f"world_size={in_factor} equal chunks; pad it to a multiple of {in_factor}"
                )
            )
        if out.numel() * in_factor != inp.numel() * out_factor:
            raise ValueError(
                self._err(
                    f"{name}: with world_size={self.world_size} the output must hold "
                    f"{inp.numel() * out_factor // in_factor} elements for an input of "
                    f"{inp.numel()}, got {out.numel()}"
                )
            )

    def _run_pending(self, until: Handle | None = None) -> None:
        """Complete queued second phases in issue order (all, or up to ``until``)."""
        while self._pending:
            handle = self._pending.popleft()
            handle._complete_now()
            if handle is until:
                return

    def _enter(
        self, name: str, describe: Callable[[], tuple[int, int, int, int]], label: str = ""
    ) -> None:
        """Start a collective: finish queued phases, validate, and agree with every rank.

        ``describe`` validates this rank's arguments (raising TypeError/ValueError) and
        returns (dtype code, numel, op, root). ``label`` (what the caller moves, e.g. a
        module's name) is compared too. With ``check_consistency`` a rank whose own
        arguments are bad still joins the agreement, so it raises its error while every
        other rank raises :class:`CollectiveMismatchError` naming it, instead of waiting.
        """
        self._check_open(name)
        self._run_pending()
        self._sequence += 1
        error: Exception | None = None
        try:
            row = [_COLLECTIVE_CODE[name], *describe(), _label_code(label)]
        except (TypeError, ValueError) as exc:
            error, row = exc, [_INVALID, 0, 0, 0, 0, 0]
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
                # below this communicator is unusable (see _check_open).
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
        invalid = [r for r, other in enumerate(rows) if other[0] == _INVALID]
        if invalid:
            raise CollectiveMismatchError(
                self._err(
                    f"{name} #{sequence}: ranks {invalid} passed invalid arguments (see "
                    "their errors); this rank stops too, so that no rank waits for them"
                )
            )
        if all(other == rows[0] for other in rows):
            return
        seen = "; ".join(f"rank {r}: {_describe_call(other)}" for r, other in enumerate(rows))
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
                    f"{name} #{self._sequence}: this rank called {_describe_call(list(call))} "
                    f"where every rank agreed before on {_describe_call(list(predicted))}, "
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

    def _complete(self, handle: Handle, async_op: bool) -> Handle | None:
        if async_op:
            return handle
        handle.wait()
        return None

    def _divide_by_world(self, tensor: torch.Tensor) -> Callable[[], None]:
        def divide() -> None:
            tensor.div_(self.world_size)

        return divide

    def _ordered(self, collective: str, op: ReduceOp, dtype: torch.dtype) -> bool:
        exact_in_any_order = op in (ReduceOp.MAX, ReduceOp.MIN) or not dtype.is_floating_point
        if self._prefers_ordered(collective, dtype):
            return True
        return self.deterministic and not exact_in_any_order

    # --------------------------------------------------------------- collectives
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str = "",
    ) -> Handle | None:
        """Reduce ``tensor`` elementwise across ranks, in place, on every rank.

        ``label`` (every collective takes one) names what is moved, for the consistency
        check: ranks passing different labels get a CollectiveMismatchError naming them."""
        name = "all_reduce"

        def describe() -> tuple[int, int, int, int]:
            self._check_tensor(name, "tensor", tensor)
            self._check_op(name, op, tensor.dtype)
            return _DTYPE_CODE[tensor.dtype], tensor.numel(), op.value, -1

        self._enter(name, describe, label)
        self.stats.record(name, tensor.numel(), tensor.element_size())
        flat = tensor.view(-1)
        if self.world_size == 1 or flat.numel() == 0:
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        if self._ordered(name, op, tensor.dtype):
            return self._complete(self._ordered_all_reduce(flat, op), async_op)
        native_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        finish = self._divide_by_world(flat) if op is ReduceOp.AVG else None
        work = self._all_reduce_native(flat, native_op)
        return self._complete(Handle(self, name, work, finish), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str = "",
    ) -> Handle | None:
        """``output`` on rank r = reduction over ranks of chunk r of ``input``.

        ``input`` holds ``world_size`` equal chunks of ``output.numel()`` elements.
        """
        name = "reduce_scatter"

        def describe() -> tuple[int, int, int, int]:
            self._check_pair(name, output, input, 1, self.world_size)
            self._check_op(name, op, input.dtype)
            return _DTYPE_CODE[input.dtype], input.numel(), op.value, -1

        self._enter(name, describe, label)
        self.stats.record(name, input.numel(), input.element_size())
        out, inp = output.view(-1), input.view(-1)
        if self.world_size == 1 or out.numel() == 0:
            out.copy_(inp)
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        if self._ordered(name, op, input.dtype):
            rows = self.buffers.take(inp.numel(), inp.dtype)
            work = self._all_to_all(rows, inp)

            def fold() -> None:
                fold_rows(out, rows.view(self.world_size, -1), op)
                self.buffers.give_back(rows)

            return self._complete(Handle(self, name, work, fold), async_op)
        native_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        finish = self._divide_by_world(out) if op is ReduceOp.AVG else None
        work = self._reduce_scatter_native(out, inp, native_op)
        return self._complete(Handle(self, name, work, finish), async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, label: str = ""
    ) -> Handle | None:
        """``output`` = concatenation of every rank's ``input``, in rank order."""
        name = "all_gather"

        def describe() -> tuple[int, int, int, int]:
            self._check_pair(name, output, input, self.world_size, 1)
            return _DTYPE_CODE[input.dtype], input.numel(), -1, -1

        self._enter(name, describe, label)
        self.stats.record(name, output.numel(), output.element_size())
        out, inp = output.view(-1), input.view(-1)
        if self.world_size == 1 or inp.numel() == 0:
            out.copy_(inp)
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        return self._complete(Handle(self, name, self._all_gather(out, inp)), async_op)

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: bool = False, label: str = ""
    ) -> Handle | None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank."""
        name = "broadcast"

        def describe() -> tuple[int, int, int, int]:
            self._check_tensor(name, "tensor", tensor)
            self._check_src(name, src)
            return _DTYPE_CODE[tensor.dtype], tensor.numel(), -1, src

        self._enter(name, describe, label)
        self.stats.record(name, tensor.numel(), tensor.element_size())
        if self.world_size == 1 or tensor.numel() == 0:
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        return self._complete(Handle(self, name, self._broadcast(tensor.view(-1), src)), async_op)

    def barrier(self, *, async_op: bool = False) -> Handle | None:
        """Return (or complete the handle) only when every rank has entered the barrier."""
        self._enter("barrier", lambda: (-1, 0, -1, -1))
        self.stats.record("barrier", 0, 1)
        work = self._barrier() if self.world_size > 1 else CompletedWork()
        return self._complete(Handle(self, "barrier", work), async_op)

    def split(self, color: int, key: int | None = None) -> Communicator:
        """Collective: ranks passing the same ``color`` form a new communicator.

        Ranks of the new group are ordered by ``key`` (default: the rank here), ties by
        rank. The new communicator inherits ``deterministic``, ``check_consistency`` and
        ``timeout``. For a tensor-parallel x data-parallel mesh of ``tp`` columns:
        ``tp_group = comm.split(color=rank // tp)``, ``dp_group = comm.split(color=rank % tp)``.
        """

        def describe() -> tuple[int, int, int, int]:
            if not isinstance(color, int) or color < 0:
                raise ValueError(self._err(f"split: color must be an int >= 0, got {color!r}"))
            if key is not None and not isinstance(key, int):
                raise ValueError(self._err(f"split: key must be an int or None, got {key!r}"))
            return -1, 0, -1, -1

        self._enter("split", describe)
        return self._split(color, self.rank if key is None else key)

    # ---------------------------------------------------------- rank-ordered sums
    def _ordered_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> Handle:
        n, size = flat.numel(), self.world_size
        chunk = chunk_numel(n, size)
        padded = chunk * size
        if padded == n:
            send = flat
        else:
            send = self.buffers.take(padded, flat.dtype)
            send[:n].copy_(flat)
            send[n:].zero_()
        rows = self.buffers.take(padded, flat.dtype)
        work = self._all_to_all(rows, send)

        def fold_then_gather() -> None:
            mine = self.buffers.take(chunk, flat.dtype)
            fold_rows(mine, rows.view(size, chunk), op)
            self._wait(self._all_gather(send, mine), "all_reduce (gather phase)")
            if send is not flat:
                flat.copy_(send[:n])
                self.buffers.give_back(send)
            self.buffers.give_back(mine)
            self.buffers.give_back(rows)

        handle = Handle(self, "all_reduce", work, fold_then_gather)
        self._pending.append(handle)  # its gather phase must keep its place in the order
        return handle

    # --------------------------------------------------------- object collectives
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Pickle ``obj`` on ``src`` and return a copy on every rank (not counted in stats)."""
        self._enter(
            "broadcast_object", lambda: (-1, 0, -1, self._check_src("broadcast_object", src))
        )
        if self.world_size == 1:
            return obj
        payload = _to_bytes(obj, self.device) if self.rank == src else None
        size = torch.tensor(
            [payload.numel() if payload is not None else 0], dtype=torch.int64, device=self.device
        )
        self._wait(self._broadcast(size, src), "broadcast_object (size)")
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if payload.numel() > 0:
            self._wait(self._broadcast(payload, src), "broadcast_object")
        return pickle.loads(payload.cpu().numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Pickle ``obj`` on every rank and return the list of all ranks' objects."""
        self._enter("all_gather_object", lambda: (-1, 0, -1, -1))
        if self.world_size == 1:
            return [obj]
        payload = _to_bytes(obj, self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self._wait(self._all_gather(sizes, size), "all_gather_object (sizes)")
        longest = int(sizes.max().item())
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: payload.numel()].copy_(payload)
        everyone = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
        self._wait(self._all_gather(everyone, padded), "all_gather_object")
        rows = everyone.view(self.world_size, longest).cpu()
        return [
            pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)
        ]


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(pickle.dumps(obj))
    return (
        torch.frombuffer(data, dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )


def _describe_call(row: list[int]) -> str:
    collective, dtype_code, numel, op, root, label = row
    name = _CODE_COLLECTIVE.get(collective, f"collective#{collective}")
    parts = []
    if 0 <= dtype_code < len(SUPPORTED_DTYPES):
        parts += [str(SUPPORTED_DTYPES[dtype_code]).removeprefix("torch."), f"numel={numel}"]
    if op in {o.value for o in ReduceOp}:
        parts.append(ReduceOp(op).name)
    if root >= 0:
        parts.append(f"src={root}")
    if label:
        parts.append(repr(_LABELS.get(label, f"label#{label:x}")))
    return f"{name}({', '.join(parts)})"
