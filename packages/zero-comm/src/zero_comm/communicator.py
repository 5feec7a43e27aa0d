"""The :class:`Communicator` interface, and what every backend shares.

A backend implements five primitives that move bytes without reducing them, or that
reduce in the backend's own order:

    _all_to_all(out, inp)        rank r receives chunk r of every rank's inp, in rank order
    _all_gather(out, inp)        out = concat(inp of rank 0, ..., inp of rank N-1)
    _broadcast(tensor, src)
    _all_reduce_native(t, op)    op in SUM, MAX, MIN; order chosen by the backend
    _reduce_scatter_native(out, inp, op)

and this class builds the public collectives from them, with its bases:

    collective_checks.CollectiveChecks   each rank's argument checks
    call_check.CallCheck                 the cross-rank consistency check
    node_groups.NodeGroups               topology, intra_node / inter_node / shard groups
    object_collectives.ObjectCollectives broadcast_object, all_gather_object
    reduction_order.ReductionOrder       which reductions are rank-ordered (deterministic:
                                         float SUM and AVG), and the ordered all-reduce
    row_collectives.RowCollectives       all_reduce_rows, reduce_scatter_rows (virtual ranks)

Here: the statistics, AVG, the asynchronous handles, and the collectives' order of
operations. All tensors are flat and contiguous on ``self.device``.

Every collective of every backend passes here, so this is where a profiler's timeline
gets them: each public collective is the range ``zero::<its name>`` (``@ranged``) and
each wait ``zero::<its name>.wait`` (handle.py), see profiler_ranges.
"""

from __future__ import annotations

import abc
import logging
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, overload

import torch

from .arrival import MeetingPoint, meet
from .buffers import BufferPool
from .call_check import (
    COLLECTIVE_CODE,
    DTYPE_CODE,
    INVALID_CALL,
    CallCheck,
    label_code,
)
from .collective_checks import CollectiveChecks
from .comm_options import CommOptions
from .errors import CommError
from .handle import CompletedWork, Handle, Work
from .heartbeat import Heartbeat
from .node_groups import NodeGroups
from .object_collectives import ObjectCollectives
from .ordered import fold_rows
from .peers import Peer
from .profiler_ranges import ranged
from .reduce_op import ReduceOp
from .reduction_order import ReductionOrder
from .row_collectives import RowCollectives
from .stats import CommStats
from .topology import Topology

log = logging.getLogger(__name__)


# CollectiveChecks and ReductionOrder stand before the bases that declare their methods
# abstract (CallCheck, ObjectCollectives, RowCollectives), so theirs are the ones found.
class Communicator(
    CollectiveChecks, CallCheck, NodeGroups, ObjectCollectives, ReductionOrder, RowCollectives
):
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
        heartbeat_timeout: seconds a peer a collective waits on may go without a heartbeat
            before it is named as stuck (zero_comm.heartbeat).
        stats: calls and ring-convention volume per collective, split into intra-node and
            inter-node bytes by ``topology``.
        topology: which of its ranks share a node (zero_comm.topology); the world's is
            detected at init, a split inherits its members' nodes, and
            :meth:`set_topology` overrides it.
        parent_ranks: for a communicator made by ``split``, the rank in the parent of each
            of its ranks; None for a world communicator.
    """

    # The world's heartbeat (zero_comm.heartbeat), shared by the communicators split from
    # it; a backend that has one sets it. None: one rank, simulated ranks, MPI without it.
    _heartbeat: Heartbeat | None = None

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        options: CommOptions,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.deterministic = options.deterministic
        self._init_call_check(options.check_consistency)
        self.timeout = options.timeout
        self.heartbeat_timeout = options.heartbeat_timeout
        self._topology = Topology.single_node(world_size)
        self.stats = CommStats(world_size, rank=rank, topology=self._topology)
        self.parent_ranks: list[int] | None = None
        # Sub-communicators made by intra_node, inter_node and shard_groups, by request.
        self._groups: dict[tuple[str, int], tuple[Communicator, ...]] = {}
        # Communicators split from this one (weakly: an engine's groups die with it).
        self._children: list[weakref.ref[Communicator]] = []
        self.buffers = BufferPool(device)
        self._sequence = 0
        self.closed = False
        # The collective whose wait failed (a dead peer, a timeout): the ranks are out of
        # step from there, so this communicator takes no other collective.
        self._failed: str | None = None
        self._pending: deque[Handle] = deque()
        # zero_comm.quantized's qgZ handles not yet waited for, in issue order: their waits
        # issue this communicator's collectives, which must keep one order on every rank.
        self._quantized_waits: deque[Any] = deque()
        # (host, pid) of every rank, where the backend knows them (see peers.py).
        self.peers: list[Peer] | None = None
        log.debug(
            "communicator created: backend %s, rank %d of %d, device %s, deterministic %s, "
            "consistency check %s, timeout %s s",
            backend, rank, world_size, device, self.deterministic, options.check_consistency,
            self.timeout,
        )  # fmt: skip

    @property
    def options(self) -> CommOptions:
        """This communicator's options now (what a subgroup split from it inherits)."""
        return CommOptions(
            self.deterministic, self.check_consistency, self.timeout, self.heartbeat_timeout
        )

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

    def meet(
        self, label: str, *, within: float | None = None, longer: str = "meet(within=...)"
    ) -> None:
        """Collective: return once every rank has called ``meet(label)``; a rank that
        waits names, in seconds, the ranks that exited without calling it, and after
        ``within`` seconds (default and at most the collective timeout) those alive
        elsewhere, warning once after a minute (zero_comm.arrival).
        Call it before a collective that user code may call on some ranks only. Nothing
        happens where the backend has no store to meet in (simulated ranks, MPI without
        its heartbeat store). ``longer``: how the caller's user waits longer, for errors."""
        self._check_open("meet")
        if within is not None and not within > 0:
            raise ValueError(f"meet(within={within}): give seconds > 0")
        limit = self.timeout if within is None else min(within, self.timeout)
        point = self._meeting_point() if self.world_size > 1 else None
        if point is not None:
            meet(point, self.rank, self.world_size, label, limit, longer)

    def _meeting_point(self) -> MeetingPoint | None:
        """The store this communicator's ranks meet in (zero_comm.arrival), if any."""
        return None

    def leave(self, how: str | None = None) -> None:
        """Say to the other ranks that this one takes part in no more collectives, as it
        is about to end without closing (``os._exit`` after a fatal error, which skips the
        check-out made at interpreter exit): a rank waiting on it then names it at once,
        "rank 1 (host h, pid p) left the job (HOW)", instead of after heartbeat_timeout.
        ``how``: why, in the peers' words ("it ran out of memory in the build"); None:
        the failure this rank met in a collective, else "its script ended". Not
        collective; at most once per process; never raises. Nothing happens where there
        is no heartbeat (one rank, simulated ranks, MPI without its store)."""
        if self._heartbeat is not None:
            self._heartbeat.check_out(how)

    def close(self) -> None:
        """Release the backend's resources; the communicator cannot be used afterwards."""
        self.closed = True
        self.buffers.clear()

    # ------------------------------------------------------------------ checks
    # (of the arguments: collective_checks.CollectiveChecks)
    def _check_open(self, name: str) -> None:
        if self.closed:
            raise CommError(self._err(f"{name}: this communicator was closed; create a new one"))
        if self._failed is not None:
            raise CommError(
                self._err(
                    f"{name}: this communicator failed at {self._failed} (see that error): its "
                    "ranks are out of step, so it takes no other collective. Restart the job."
                )
            )
        self._check_not_diverged(name)

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
            row = [COLLECTIVE_CODE[name], *describe(), label_code(label)]
        except (TypeError, ValueError) as exc:
            error, row = exc, [INVALID_CALL, 0, 0, 0, 0, 0]
        self._agree(name, row, error)

    def _complete(self, handle: Handle, async_op: bool) -> Handle | None:
        if async_op:
            return handle
        handle.wait()
        return None

    def _divide_by_world(self, tensor: torch.Tensor) -> Callable[[], None]:
        def divide() -> None:
            tensor.div_(self.world_size)

        return divide

    # --------------------------------------------------------------- collectives
    # Each collective's overloads say what async_op gives: a Handle for True, None for
    # False, so a caller never needs to assert the handle's presence (typing only).
    @overload
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ...,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ..., *, async_op: Literal[True], label: str = ...
    ) -> Handle: ...
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ..., *, async_op: bool, label: str = ...
    ) -> Handle | None: ...
    @ranged
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
            return DTYPE_CODE[tensor.dtype], tensor.numel(), op.value, -1

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

    @overload
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ...,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ...,
        *,
        async_op: Literal[True],
        label: str = ...,
    ) -> Handle: ...
    @overload
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ...,
        *,
        async_op: bool,
        label: str = ...,
    ) -> Handle | None: ...
    @ranged
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
            return DTYPE_CODE[input.dtype], input.numel(), op.value, -1

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

    @overload
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: Literal[True],
        label: str = ...,
    ) -> Handle: ...
    @overload
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, label: str = ...
    ) -> Handle | None: ...
    @ranged
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, label: str = ""
    ) -> Handle | None:
        """``output`` = concatenation of every rank's ``input``, in rank order."""
        name = "all_gather"

        def describe() -> tuple[int, int, int, int]:
            self._check_pair(name, output, input, self.world_size, 1)
            return DTYPE_CODE[input.dtype], input.numel(), -1, -1

        self._enter(name, describe, label)
        self.stats.record(name, output.numel(), output.element_size())
        out, inp = output.view(-1), input.view(-1)
        if self.world_size == 1 or inp.numel() == 0:
            out.copy_(inp)
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        return self._complete(Handle(self, name, self._all_gather(out, inp)), async_op)

    @overload
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: Literal[True],
        label: str = ...,
    ) -> Handle: ...
    @overload
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, label: str = ...
    ) -> Handle | None: ...
    @ranged
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, label: str = ""
    ) -> Handle | None:
        """Chunk i of ``output`` = chunk r of rank i's ``input``, on rank r.

        Both hold ``world_size`` equal chunks. Nothing is reduced, so the result is exact
        on every backend."""
        name = "all_to_all"

        def describe() -> tuple[int, int, int, int]:
            self._check_pair(name, output, input, self.world_size, self.world_size)
            return DTYPE_CODE[input.dtype], input.numel(), -1, -1

        self._enter(name, describe, label)
        self.stats.record(name, input.numel(), input.element_size())
        out, inp = output.view(-1), input.view(-1)
        if self.world_size == 1 or inp.numel() == 0:
            out.copy_(inp)
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        return self._complete(Handle(self, name, self._all_to_all(out, inp)), async_op)

    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: Literal[False] = ..., label: str = ...
    ) -> None: ...
    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: Literal[True], label: str = ...
    ) -> Handle: ...
    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: bool, label: str = ...
    ) -> Handle | None: ...
    @ranged
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, async_op: bool = False, label: str = ""
    ) -> Handle | None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank."""
        name = "broadcast"

        def describe() -> tuple[int, int, int, int]:
            self._check_tensor(name, "tensor", tensor)
            self._check_src(name, src)
            return DTYPE_CODE[tensor.dtype], tensor.numel(), -1, src

        self._enter(name, describe, label)
        self.stats.record(name, tensor.numel(), tensor.element_size(), root=src)
        if self.world_size == 1 or tensor.numel() == 0:
            return self._complete(Handle(self, name, CompletedWork()), async_op)
        return self._complete(Handle(self, name, self._broadcast(tensor.view(-1), src)), async_op)

    @overload
    def barrier(self, *, async_op: Literal[False] = ...) -> None: ...
    @overload
    def barrier(self, *, async_op: Literal[True]) -> Handle: ...
    @overload
    def barrier(self, *, async_op: bool) -> Handle | None: ...
    @ranged
    def barrier(self, *, async_op: bool = False) -> Handle | None:
        """Return (or complete the handle) only when every rank has entered the barrier."""
        self._enter("barrier", lambda: (-1, 0, -1, -1))
        self.stats.record("barrier", 0, 1)
        work = self._barrier() if self.world_size > 1 else CompletedWork()
        return self._complete(Handle(self, "barrier", work), async_op)

    @ranged
    def split(self, color: int, key: int | None = None) -> Communicator:
        """Collective: ranks passing the same ``color`` form a new communicator.

        Ranks of the new group are ordered by ``key`` (default: the rank here), ties by
        rank. The new communicator inherits ``deterministic``, ``check_consistency`` and
        ``timeout``, and its members' nodes (``topology``, in the world's node numbers).
        For a tensor-parallel x data-parallel mesh of ``tp`` columns:
        ``tp_group = comm.split(color=rank // tp)``, ``dp_group = comm.split(color=rank % tp)``.
        """

        def describe() -> tuple[int, int, int, int]:
            if not isinstance(color, int) or color < 0:
                raise ValueError(self._err(f"split: color must be an int >= 0, got {color!r}"))
            if key is not None and not isinstance(key, int):
                raise ValueError(self._err(f"split: key must be an int or None, got {key!r}"))
            return -1, 0, -1, -1

        self._enter("split", describe)
        child = self._split(color, self.rank if key is None else key)
        if child.parent_ranks is None:  # a backend that does not know its members' ranks
            child.parent_ranks = child.all_gather_object(self.rank)
        child.set_topology(self.topology.restrict(child.parent_ranks))
        self._children.append(weakref.ref(child))
        return child
