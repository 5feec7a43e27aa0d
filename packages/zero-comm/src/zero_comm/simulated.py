"""An in-process world of N ranks, one thread each, for fast property tests.

Collectives are exchanges through shared slots between two barrier waits:

    rank r: slots[r] = my tensor -> barrier -> read slots[*] -> barrier

so every rank reads every other rank's tensor while none of them can change it. This is
the same :class:`Communicator` code path as the real backends (checks, stats, rank-ordered
reductions); only the five primitives differ. The native reductions add in the order a
ring algorithm would (chunk j starts at rank j+1), which is *not* rank order, so a caller
that forgets ``deterministic=True`` sees the same kind of differences as on gloo or MPI.

A rank that raises breaks the barrier, and every other rank stops at its next collective
with :class:`CommError` instead of waiting for the timeout.

The digest consistency check's out-of-band channel is a dictionary of posted calls.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .comm_options import CommOptions
from .communicator import Communicator
from .errors import CommError, CommTimeoutError
from .handle import CompletedWork, Work
from .ordered import chunk_numel
from .reduce_op import ReduceOp
from .topology import Topology

T = TypeVar("T")


class _Broken(Exception):
    """The meeting point was abandoned: a rank failed, or one waited past the timeout."""


class _SharedWorld:
    """What the threads of one simulated group share."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.slots: list[Any] = [None] * world_size
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.children: dict[tuple[int, int], _SharedWorld] = {}
        self.arrived = [0] * world_size
        self.failed = False
        self.broken = False
        self._waiting = 0
        self._generation = 0
        # The digest check's channel: sequence number -> {rank: call}.
        self.calls: dict[int, dict[int, list[int]]] = {}
        self.collected: dict[int, int] = {}

    def meet(self, poll: Callable[[], None]) -> None:
        """Wait until every rank has called ``meet`` (a barrier); ``poll`` runs every few
        milliseconds meanwhile (the digest check looks for posted calls there)."""
        deadline = time.monotonic() + self.timeout
        with self.changed:
            if self.failed or self.broken:
                raise _Broken
            generation = self._generation
            self._waiting += 1
            if self._waiting == self.world_size:
                self._waiting = 0
                self._generation += 1
                self.changed.notify_all()
                return
        while True:
            poll()
            with self.changed:
                if self._generation != generation:
                    return
                if self.failed or self.broken:
                    raise _Broken
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.broken = True
                    self.changed.notify_all()
                    raise _Broken
                self.changed.wait(min(remaining, 0.005))

    def abort(self) -> None:
        """A rank failed: release every rank waiting here or in any descendant group."""
        with self.changed:
            self.failed = True
            self.changed.notify_all()
            children = list(self.children.values())
        for child in children:
            child.abort()


class SimulatedCommunicator(Communicator):
    """One rank of a simulated world; create them with :func:`run_simulated`."""

    def __init__(
        self,
        shared: _SharedWorld,
        rank: int,
        *,
        options: CommOptions,
        defer_outputs: bool = False,
    ) -> None:
        super().__init__(
            rank=rank,
            world_size=shared.world_size,
            backend="simulated",
            device=torch.device("cpu"),
            options=options,
        )
        self._shared = shared
        self._splits = 0
        self.defer_outputs = defer_outputs
        self._random = random.Random(rank)

    def _deliver(self, out: torch.Tensor, result: torch.Tensor) -> Work:
        """Write ``result`` into ``out`` now, or (``defer_outputs``) only when the work is
        waited on, after a random pause: as a real backend, whose output is not there before
        wait(). A caller that forgets a wait reads stale data and fails its checks."""
        if not self.defer_outputs:
            out.copy_(result)
            return CompletedWork()
        return _DeferredWork(out, result, self._random.random() * 1e-3)

    def _sync(self) -> None:
        shared = self._shared
        try:
            shared.meet(self._join_resolution)
        except _Broken:
            if shared.failed:
                raise CommError(self._err("a peer failed; this collective was abandoned")) from None
            behind = [r for r, n in enumerate(shared.arrived) if n < max(shared.arrived)]
            raise CommTimeoutError(
                self._err(
                    f"collective did not complete within {shared.timeout}s: ranks {behind} "
                    "never arrived (they failed, are stuck, or called fewer collectives)"
                )
            ) from None

    def _exchange(self, value: Any) -> list[Any]:
        shared = self._shared
        shared.slots[self.rank] = value
        shared.arrived[self.rank] += 1
        self._sync()
        everyone = list(shared.slots)
        self._sync()
        return everyone

    def _wait(self, work: Work, name: str) -> None:
        work.wait()

    def _post_call(self, sequence: int, call: tuple[int, ...]) -> None:
        shared = self._shared
        with shared.changed:
            shared.calls.setdefault(sequence, {})[self.rank] = list(call)
            shared.changed.notify_all()

    def _posted_call(self) -> int | None:
        shared = self._shared
        with shared.lock:
            waiting = [s for s, calls in shared.calls.items() if self.rank not in calls]
        return min(waiting, default=None)

    def _collect_calls(self, sequence: int, call: tuple[int, ...], what: str) -> list[list[int]]:
        shared = self._shared
        with shared.changed:
            posted = shared.calls[sequence]
            complete = shared.changed.wait_for(
                lambda: len(posted) == self.world_size or shared.failed, shared.timeout
            )
            if shared.failed:
                raise CommError(self._err("a peer failed; this collective was abandoned"))
            if not complete:
                missing = sorted(set(range(self.world_size)) - set(posted))
                raise CommTimeoutError(
                    self._err(
                        f"{what} did not complete within "
                        f"{shared.timeout}s: ranks {missing} never arrived (they failed, are "
                        "stuck, or called fewer collectives)"
                    )
                )
            rows = [posted[r] for r in range(self.world_size)]
            shared.collected[sequence] = shared.collected.get(sequence, 0) + 1
            if shared.collected[sequence] == self.world_size:
                del shared.calls[sequence], shared.collected[sequence]
        return rows

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        size = self.world_size
        everyone = self._exchange(inp)
        rows = torch.stack([theirs.view(size, -1)[self.rank] for theirs in everyone])
        self._exchange(None)  # nobody may overwrite an input until all have copied it
        return self._deliver(out, rows.view(-1))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        everyone = self._exchange(inp.clone())
        return self._deliver(out, torch.cat(everyone))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        everyone = self._exchange(tensor.clone() if self.rank == src else None)
        if self.rank == src:
            return CompletedWork()
        return self._deliver(tensor, everyone[src])

    def _ring_order_reduce(
        self, parts: list[torch.Tensor], chunk: int, op: ReduceOp
    ) -> torch.Tensor:
        """Reduce chunk ``chunk`` of the ranks' parts starting at rank chunk+1, as a ring does."""
        size = self.world_size
        order = [(chunk + 1 + i) % size for i in range(size)]
        total = parts[order[0]].clone()
        for r in order[1:]:
            if op is ReduceOp.SUM:
                total = total + parts[r]
            elif op is ReduceOp.MAX:
                total = torch.maximum(total, parts[r])
            else:
                total = torch.minimum(total, parts[r])
        return total

    def _all_reduce_native(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        size = self.world_size
        everyone = self._exchange(tensor.clone())
        chunk = chunk_numel(tensor.numel(), size)
        result = torch.empty_like(tensor)
        for j in range(size):
            lo, hi = min(j * chunk, tensor.numel()), min((j + 1) * chunk, tensor.numel())
            parts = [t[lo:hi] for t in everyone]
            result[lo:hi] = self._ring_order_reduce(parts, j, op)
        return self._deliver(tensor, result)

    def _reduce_scatter_native(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> Work:
        everyone = self._exchange(inp.clone())
        parts = [t.view(self.world_size, -1)[self.rank] for t in everyone]
        return self._deliver(out, self._ring_order_reduce(parts, self.rank, op))

    def _barrier(self) -> Work:
        self._exchange(None)
        return CompletedWork()

    def _split(self, color: int, key: int) -> Communicator:
        self._splits += 1
        everyone = self._exchange((color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)
        new_rank = [r for _, r in members].index(self.rank)
        with self._shared.lock:
            child = self._shared.children.setdefault(
                (self._splits, color), _SharedWorld(len(members), self._shared.timeout)
            )
        self._exchange(None)  # every child exists before anyone uses it
        sub = SimulatedCommunicator(
            child, new_rank, options=self.options, defer_outputs=self.defer_outputs
        )
        sub.parent_ranks = [r for _, r in members]
        return sub


class _DeferredWork:
    """Output that lands only at ``wait()`` (see ``SimulatedCommunicator._deliver``)."""

    def __init__(self, out: torch.Tensor, result: torch.Tensor, pause_s: float) -> None:
        self._out, self._pause_s = out, pause_s
        self._result: torch.Tensor | None = result

    def wait(self) -> None:
        if self._result is None:
            return
        time.sleep(self._pause_s)
        self._out.copy_(self._result)
        self._result = None


_math_libraries_ready = False


def _ready_math_libraries() -> None:
    """Make the process's first matrix products here, in the calling thread, once.

    MKL sets itself up on its first call. When that first call comes from several rank
    threads at once, some of the products computed meanwhile get other bits: 7 of 40
    fresh processes trained a 3-rank stage 0 to other weights in their first simulated
    run than in every later one, and none of 40 did once the caller had made one product
    first. Real ranks are processes whose main thread makes the first call alone."""
    global _math_libraries_ready
    if _math_libraries_ready:
        return
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            a = torch.ones(4, 33, dtype=dtype)
            b = torch.ones(33, 33, dtype=dtype)
            a @ b, b @ a[0], a.t() @ a, torch.addmm(a, a, b), a.sum(0)  # for their effect
    _math_libraries_ready = True


class SimulatedRankError(AssertionError):
    """A rank of a simulated world raised; the message has every failing rank's traceback."""


def run_simulated(
    world_size: int,
    body: Callable[[Communicator], T],
    *,
    deterministic: bool = True,
    check_consistency: bool | str = True,
    timeout: float = 60.0,
    defer_outputs: bool = False,
    ranks_per_node: int | None = None,
) -> list[T]:
    """Run ``body(comm)`` on ``world_size`` simulated ranks; return each rank's result.

    If any rank raises, the others are released from their collectives, and a
    :class:`SimulatedRankError` naming the first failing rank (with every failing rank's
    traceback) is raised. The original exception of the first failing rank is its cause.
    With ``defer_outputs`` the results of asynchronous collectives land only when waited on,
    after a random pause, so a missing ``wait()`` shows up as wrong numbers.
    ``ranks_per_node`` gives the world that topology (rank r on node r // ranks_per_node);
    None: every rank on one node.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    topology = (
        Topology.single_node(world_size)
        if ranks_per_node is None
        else Topology.uniform(world_size, ranks_per_node)
    )
    options = CommOptions(deterministic, check_consistency, timeout)
    _ready_math_libraries()
    shared = _SharedWorld(world_size, timeout)
    intra_op_threads = torch.get_num_threads()
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}
    tracebacks: dict[int, str] = {}

    def run_rank(rank: int) -> None:
        # A new thread starts with OpenMP's and MKL's defaults (the machine's cores), not
        # the caller's torch.set_num_threads: torch applies that to a thread only at its
        # first parallel kernel, so a rank's first matmuls would run with another thread
        # count, hence other bits, than the same matmuls later or in the caller.
        torch.set_num_threads(intra_op_threads)
        comm = SimulatedCommunicator(shared, rank, options=options, defer_outputs=defer_outputs)
        comm.set_topology(topology)
        try:
            results[rank] = body(comm)
        except BaseException as exc:
            errors[rank] = exc
            tracebacks[rank] = traceback.format_exc()
            shared.abort()

    if world_size == 1:
        run_rank(0)
    else:
        threads = [
            threading.Thread(target=run_rank, args=(r,), name=f"sim-rank-{r}")
            for r in range(world_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        # The root cause is the rank that failed with something other than a released peer
        # (a plain CommError: "a peer failed; this collective was abandoned"). Subclasses
        # such as CollectiveMismatchError are causes: a rank that saw the mismatch first
        # releases the others, which must not hide it.
        causes = {r: e for r, e in errors.items() if type(e) is not CommError} or errors
        first = min(causes)
        details = "\n".join(f"--- rank {r} ---\n{tracebacks[r]}" for r in sorted(errors))
        raise SimulatedRankError(
            f"rank {first} of {world_size} failed: {causes[first]!r}\n{details}"
        ) from causes[first]
    return results
