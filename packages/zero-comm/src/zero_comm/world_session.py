"""What a process that joined a torch.distributed world must let go of, and in which order.

    WorldSession           the world process group zero_comm created and its rendezvous
                           store: released at close or exit, rank 0 last
    InFlightCollectives    collectives issued and not yet waited for: settled before the
                           group is destroyed and at interpreter exit
    AllOf                  several torch works as one Work

Used by torch_backend (the gloo and nccl communicators).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import time
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .heartbeat import Heartbeat
from .peers import Peer, is_running

_CLOSE_KEY = "zero_comm/closed"
# Rank 0's wait at exit for the others to let go of the store it hosts (WorldSession), and
# how often it looks for those among them that died meanwhile.
CHECK_OUT_WAIT_S = 10.0
LOOK_FOR_DEAD_S = 0.1


class WorldSession:
    """The world process group that zero_comm created, and its rendezvous store.

    torch.distributed keeps the default process group in module globals, so this mirrors
    it: one session per process, shared by every world communicator ``init`` returns.

    Destroying the process group while a peer is still inside a collective, rank 0 (which
    hosts the store) leaving before the others have let go of it, or exiting without
    destroying it at all, aborts the process from torch's C++ threads ("terminate called
    without an active exception"). So release lets the collectives still in flight end
    first (:class:`InFlightCollectives`), destroys the group, and rank 0 waits until every
    other rank has checked out of the store (or, on rank 0's host, is no longer running: a
    dead rank uses no store) before dropping it. A session that was never closed is released at
    interpreter exit, with a short wait.

    Each rank's heartbeat (zero_comm.heartbeat) checks out first, at close or at exit, so
    that a peer still waiting in a collective on it names it at once.
    """

    _current: WorldSession | None = None
    worlds = 0  # world communicators created in this process (every rank alike)

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        peers: list[Peer],
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.heartbeat = heartbeat

    @classmethod
    def start(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        peers: list[Peer],
        heartbeat: Heartbeat | None = None,
    ) -> None:
        if cls._current is None:
            atexit.register(cls.release, CHECK_OUT_WAIT_S)
        cls._current = cls(store, rank, world_size, peers, heartbeat)

    @classmethod
    def check_out(cls, how: str | None = None) -> None:
        """This rank joins no more collectives: say so to its peers (see Heartbeat)."""
        if cls._current is not None and cls._current.heartbeat is not None:
            cls._current.heartbeat.check_out(how)

    @classmethod
    def created_here(cls) -> bool:
        """Whether zero_comm created the default process group (else the user owns it)."""
        return cls._current is not None

    @classmethod
    def release(cls, wait_limit: float, how: str | None = None) -> None:
        """Let go of the world (``how``: what the check-out says; None at exit)."""
        cls.check_out(how)
        session, cls._current = cls._current, None
        InFlightCollectives.settle()
        stuck = session is not None and session.heartbeat is not None and session.heartbeat.named
        if dist.is_initialized() and stuck:
            keep_groups_for_good()
        elif dist.is_initialized():
            dist.destroy_process_group()
        if session is None or session.world_size == 1:
            return
        if session.rank != 0:
            # add, not set: it waits for the store's answer, so this rank is out before it
            # goes on to exit (a set is not answered; with it one exit in ~20 aborted).
            # A RuntimeError (DistNetworkError): rank 0, which hosts the store, is gone,
            # and the error that ends this rank said so; there is nothing to check out
            # from, and a traceback at exit would only bury that line.
            with contextlib.suppress(RuntimeError):
                session.store.add(check_out_key(session.rank), 1)
            return
        session.wait_for_check_outs(wait_limit)
        if session.heartbeat is not None:
            session.heartbeat.stop()

    def wait_for_check_outs(self, wait_limit: float) -> None:
        """On rank 0: wait until every other rank has checked out or, on this host, has
        died; at most ``wait_limit`` seconds (a dead rank on another host is waited out)."""
        waiting = list(range(1, self.world_size))
        deadline = time.monotonic() + wait_limit
        next_look = time.monotonic()
        while waiting and time.monotonic() < deadline:
            if self.store.check([check_out_key(r) for r in waiting]):
                return
            if time.monotonic() >= next_look:  # which are still out, and alive
                waiting = [
                    r
                    for r in waiting
                    if not self.store.check([check_out_key(r)]) and not self._died(r)
                ]
                if self.heartbeat is not None:  # stuck or gone: it will not check out
                    waiting = [r for r in waiting if r not in self.heartbeat.named]
                next_look = time.monotonic() + LOOK_FOR_DEAD_S
            time.sleep(0.005)

    def _died(self, rank: int) -> bool:
        peer = self.peers[rank]
        return peer.host == self.peers[0].host and not is_running(peer.pid)


def keep_groups_for_good() -> None:
    """Never destroy this process's process groups (it is about to exit).

    A collective is still in flight on a peer that stopped or left (the heartbeat named
    it): destroying or aborting a gloo group joins its worker threads, which wait in that
    collective until its timeout (minutes) and then abort the process ("terminate called
    after throwing an instance of 'gloo::IoException'"). One more reference to each group
    keeps it alive through the interpreter's finalization; the process ends with its own
    exit code, and its threads with it."""
    import ctypes

    for group in list(dist.distributed_c10d._world.pg_map):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def check_out_key(rank: int) -> str:
    return f"{_CLOSE_KEY}/{rank}"


class AllOf:
    """Several torch works as one :class:`Work`: done when all are; ``wait`` raises the
    first failure, in issue order."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([work.get_future() for work in self.works])


class InFlightCollectives:
    """The collectives issued on torch process groups in this process and not yet waited for.

    gloo runs each collective on a worker thread of its process group, and the thread that
    lets go of a collective last frees its tensors. Freeing a tensor whose Python object is
    gone already (its caller dropped its handle: a rank raising PeerFailureError leaves
    behind the prefetches and bucket reductions it had issued) takes the GIL. A worker thread
    that asks for the GIL in the last moments of the exit handlers is still waiting when
    the interpreter starts finalizing, and Python then ends it (pthread_exit) inside that
    C++ destructor: std::terminate, "terminate called without an active exception", and a
    rank that had reported its error cleanly dies of SIGABRT instead of its exit code.

    So every collective is held here from its issue until it is waited for, and
    :meth:`settle`, before the process group is released and at interpreter exit, waits
    until the ones left have ended (failing at once where a peer is dead, or by the
    collective's own timeout) and keeps them: no worker thread is running one, or frees
    one, while the interpreter finalizes.
    """

    works: ClassVar[dict[int, tuple[Any, float, int]]] = {}  # id(work): (work, timeout, rank)
    ended: ClassVar[list[Any]] = []  # failed or settled: let go only with the interpreter
    _exit_hook = False
    _prune_at = 1024  # a caller that never waits: its ended collectives go past this many

    @classmethod
    def issued(cls, work: Any, timeout: float, rank: int) -> None:
        cls.works[id(work)] = (work, timeout, rank)
        if not cls._exit_hook:  # after WorldSession's, so it runs before (LIFO)
            cls._exit_hook = True
            atexit.register(cls.settle)
            # Last registered, so first to run: the peers hear that this rank leaves
            # before it waits here for what it left in flight.
            atexit.register(WorldSession.check_out)
        if len(cls.works) > cls._prune_at:
            for key in [k for k, (w, _, _) in cls.works.items() if w.is_completed()]:
                del cls.works[key]
            cls._prune_at = max(1024, 2 * len(cls.works))

    @classmethod
    def waited(cls, work: Any) -> None:
        cls.works.pop(id(work), None)

    @classmethod
    def failed(cls, work: Any) -> None:
        cls.works.pop(id(work), None)
        cls.ended.append(work)

    @classmethod
    def settle(cls) -> None:
        """Wait until every collective in flight has ended, for at most the longest timeout
        among them (each ends by its own timeout), and keep them; say so on stderr if some
        have not."""
        if not cls.works:
            return
        limit = max(timeout for _, timeout, _ in cls.works.values())
        deadline = time.monotonic() + limit
        running = []
        while cls.works:
            _, (work, _, rank) = cls.works.popitem()
            cls.ended.append(work)
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.002)
            if not work.is_completed():
                running.append(rank)
        if running:
            print(
                f"zero-comm: [rank {running[0]}] {len(running)} collective(s) issued and never "
                f"waited for had not ended {limit:g}s later; the process may abort as it exits",
                file=sys.stderr,
                flush=True,
            )
