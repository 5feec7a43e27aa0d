"""The gloo and nccl backends, through torch.distributed process groups."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import sys
import threading
import time
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .arrival import MeetingPoint
from .c10d_log import quiet_cpp_warnings
from .comm_options import CommOptions
from .communicator import Communicator
from .errors import BackendUnavailableError, CommError, CommTimeoutError, PeerFailureError
from .flight_recorder import keep_flight_recorder_off
from .handle import Work
from .heartbeat import WHAT_TO_DO, Heartbeat, store_host_note
from .launcher_env import LaunchEnv
from .peers import Peer, dead_ranks, describe_dead, is_running
from .reduce_op import ReduceOp
from .rendezvous import read_peers, rendezvous_store, store_address, store_client

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}
_CLOSE_KEY = "zero_comm/closed"
# Rank 0's wait at exit for the others to let go of the store it hosts (_WorldSession), and
# how often it looks for those among them that died meanwhile.
CHECK_OUT_WAIT_S = 10.0
LOOK_FOR_DEAD_S = 0.1
# The digest check's looks for posts while a gloo collective waits (_wait_watching).
FIRST_LOOK_S = 0.01
LOOK_EVERY_S = 0.1
# A collective whose peer the heartbeat names gets this long to complete all the same: the
# peer may have checked out right after completing its part of this very collective.
LAST_CHANCE_S = 1.0
_TIMEOUT_WORDS = ("timed out", "timeout")  # matched without case
_PEER_WORDS = ("Connection closed by peer", "Connection reset", "Broken pipe", "ECONNRESET")
# gloo all-gathers of at least this many bytes per rank run as one broadcast per rank
# (TorchCommunicator._all_gather); below it the one all-gather is as fast or faster.
GLOO_GATHER_BY_BROADCAST_BYTES = 1 << 18


class TorchCommunicator(Communicator):
    """A communicator over one torch.distributed process group (gloo or nccl)."""

    def __init__(
        self,
        group: Any,
        *,
        backend: str,
        device: torch.device,
        options: CommOptions,
    ) -> None:
        super().__init__(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            backend=backend,
            device=device,
            options=options,
        )
        self.group = group
        # The digest check's channel: keys under this prefix in the rendezvous store.
        self._calls_store: Any = None
        self._calls_prefix = ""
        self._posts_seen = 0
        self._splits = 0
        # The world's heartbeat (zero_comm.heartbeat), shared by the communicators split
        # from it; None for one rank, or where an adopted group has none (zero_comm.adopt).
        self._heartbeat: Heartbeat | None = None
        # Whether close() destroys the process group: False for a group zero_comm adopted
        # (zero_comm.adopt), which stays its creator's.
        self.owns_group = True
        # Whether the world is one zero_comm adopted (its splits inherit it): there the
        # application may have made groups of its own, which changes how a split's group
        # must be made (_new_group).
        self.adopted_world = False

    @classmethod
    def create(
        cls,
        backend: str,
        env: LaunchEnv,
        options: CommOptions,
    ) -> TorchCommunicator:
        """Rendezvous and create the world process group, or reuse an existing one."""
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise BackendUnavailableError(
                    f"[rank {env.rank}] backend 'nccl' needs CUDA, and torch sees no GPU here; "
                    "use backend='gloo' (or 'auto') on CPU machines"
                )
            if not dist.is_nccl_available():
                raise BackendUnavailableError(
                    f"[rank {env.rank}] this torch build has no NCCL; install a CUDA build of torch"
                )
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            if not dist.is_gloo_available():
                raise BackendUnavailableError(f"[rank {env.rank}] this torch build has no gloo")
            device = torch.device("cpu")
        peers: list[Peer] | None = None
        if dist.is_initialized():
            existing = dist.get_backend()
            if existing != backend:
                raise BackendUnavailableError(
                    f"[rank {env.rank}] torch.distributed is already initialised with "
                    f"{existing!r}; ask zero_comm.init for backend={existing!r}"
                )
        else:
            keep_flight_recorder_off()  # its entries fragment the heap (flight_recorder.py)
            quiet_cpp_warnings()  # a dead rank 0's store: one line, not c10d's stacks
            store = rendezvous_store(env, options.timeout)
            peers = read_peers(store, env.world_size)
            heartbeat = None
            if env.world_size > 1:
                heartbeat = Heartbeat(
                    lambda: store_client(store, options.heartbeat_timeout),
                    rank=env.rank,
                    peers=peers,
                    heartbeat_timeout=options.heartbeat_timeout,
                    store_address=store_address(store),
                )
            _WorldSession.start(store, env.rank, env.world_size, peers, heartbeat)
            if heartbeat is not None:
                heartbeat.start()  # its exit handler after the session's: it runs first
            dist.init_process_group(
                backend,
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=datetime.timedelta(seconds=options.timeout),
            )
        world = cls(dist.group.WORLD, backend=backend, device=device, options=options)
        world.peers = peers
        if _WorldSession._current is not None:
            world._heartbeat = _WorldSession._current.heartbeat
        world._calls_store = (
            _WorldSession._current.store
            if _WorldSession._current is not None
            else dist.distributed_c10d._get_default_store()
        )
        _WorldSession.worlds += 1
        world._calls_prefix = f"zero_comm/calls/{_WorldSession.worlds}"
        return world

    def _wait(self, work: Work, name: str) -> None:
        silent = self._wait_watching(work)
        if silent is not None:
            # Kept, not let go: its worker thread is still in it (_InFlight).
            _InFlight.failed(work)
            if self._failed is None:
                self._failed = f"{name} #{self._sequence}"
            self._note_failure(silent)
            raise PeerFailureError(self._err(f"{name}: {silent}. {WHAT_TO_DO}"))
        try:
            work.wait()
        except RuntimeError as exc:
            # Kept, not let go: its worker thread may not have let go of it yet (_InFlight).
            _InFlight.failed(work)
            if self._failed is None:
                self._failed = f"{name} #{self._sequence}"
            raise self._failure(name, str(exc)) from exc
        _InFlight.waited(work)

    def _wait_watching(self, work: Work) -> str | None:
        """Block until ``work`` completes, or until the heartbeat names a member of this
        group that checked out or stopped beating (then that sentence; the work is left in
        flight). Not on nccl, where wait() does not block the host.

        With the digest check, it also looks for another rank's post 10, 20, 40, ...
        ms in (then every 100 ms): a resolution that rank has started must be joined, or
        this collective never completes (see call_schedule.py). A look is a round trip
        to the rendezvous store, across the slow link for another node's ranks, so the
        first comes late: most waits end before it, and only a diverging rank, which is
        rare, waits for one. The heartbeat's verdict is a look at what its thread read
        last, every beat (zero_comm.heartbeat), no round trip.

        The thread sleeps on an event that the collective's future sets, rather than
        polling ``is_completed``: with more ranks than cores a polling waiter takes the CPU
        from the ranks and the gloo threads it waits for (ZeRO++'s step on 2 cores, 4 ranks:
        ~8% of it, docs/across-nodes.md), and wakes up to 100 us late."""
        if self.backend != "gloo":
            return None
        looking = self._check_mode == "digest" and not self._resolving
        heartbeat = self._heartbeat
        if not looking and heartbeat is None:
            return None
        if work.is_completed():  # type: ignore[attr-defined]
            return None  # most waits in a step: no event, no callback
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _: finished.set())  # type: ignore[attr-defined]
        start = time.monotonic()
        next_look = FIRST_LOOK_S if looking else math.inf
        next_beat = heartbeat.period if heartbeat is not None else math.inf
        with heartbeat.watching() if heartbeat is not None else contextlib.nullcontext():
            while not finished.wait(max(0.0, start + min(next_look, next_beat) - time.monotonic())):
                waited = time.monotonic() - start
                if waited >= next_look:
                    self._join_resolution()
                    next_look = min(2 * next_look, time.monotonic() - start + LOOK_EVERY_S)
                if heartbeat is not None and waited >= next_beat:
                    silent = heartbeat.verdict(self.peers)
                    if silent is not None and not finished.wait(LAST_CHANCE_S):
                        return silent
                    next_beat = waited + heartbeat.period
        return None

    def _failure(self, name: str, text: str) -> CommError:
        """The error for collective ``name`` whose wait raised ``text``."""
        lowered = text.lower()
        if any(word.lower() in lowered for word in _PEER_WORDS):
            # A check-out read already names a peer that left; a dead peer of this host is
            # named by /proc within a second; else the heartbeat may say within two beats
            # (a peer on another host that exited, or rank 0's store that went with it).
            # A peer of this host that died without checking out (killed) is the first
            # cause: named before a peer that checked out after meeting that failure.
            heard, left = None, set()
            if self._heartbeat is not None:
                self._heartbeat.read_now()
                left = self._heartbeat.left_ranks()
            gone = dead_ranks(self.peers, self.rank)[0] if self.peers else []
            killed = [r for r in gone if r not in left]
            if self._heartbeat is not None and not killed:
                heard = self._heartbeat.verdict(self.peers)
            dead = describe_dead(self.peers, self.rank, exclude=left)
            if (
                heard is None
                and self._heartbeat is not None
                and not (self.peers and dead_ranks(self.peers, self.rank)[0])  # after settling
            ):
                heard = self._heartbeat.verdict_within_beats(self.peers, 2)
            if heard is not None:
                self._note_failure(heard)
                return PeerFailureError(self._err(f"{name}: {heard}. {WHAT_TO_DO}"))
            if dead:
                self._note_failure(dead.strip())
            return PeerFailureError(
                self._err(
                    f"{name}: a peer closed its connection, most likely because its process "
                    f"died.{dead}{store_host_note(self._heartbeat, self.peers)} "
                    f"See the launcher's report and that rank's log ({text.strip()})"
                )
            )
        if any(word in lowered for word in _TIMEOUT_WORDS):
            return CommTimeoutError(
                self._err(
                    f"{name}: no answer from the other ranks within {self.timeout}s; a peer "
                    f"is stuck, dead, or called a different collective."
                    f"{describe_dead(self.peers, self.rank)} ({text.strip()})"
                )
            )
        return CommError(self._err(f"{name} failed: {text.strip()}"))

    def _note_failure(self, said: str) -> None:
        """What this rank's check-out will say: the failure that ends it (so the ranks
        that wait on it next name the peer that failed first, through it)."""
        if self._heartbeat is not None:
            self._heartbeat.ending = f"its collective failed: {said}"

    def _store_lost(self, what: str, exc: RuntimeError) -> CommError:
        """The error for a digest-check store call that failed with ``exc``: the store's
        host, rank 0, is gone (or stopped) where the heartbeat knows it."""
        if self._failed is None:
            self._failed = f"{what} #{self._sequence}"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        heartbeat = self._heartbeat
        if heartbeat is not None and self.rank != 0:
            said = heartbeat.store_lost(first_line)
            return PeerFailureError(self._err(f"{what}: {said}. {WHAT_TO_DO}"))
        return CommError(self._err(f"{what}: the rendezvous store failed ({first_line})"))

    def _meeting_point(self) -> MeetingPoint | None:
        if self._calls_store is None:
            return None
        prefix = f"{self._calls_prefix}/meet"
        return MeetingPoint(self._calls_store, prefix, self.peers, self._heartbeat)

    def _post_call(self, sequence: int, call: tuple[int, ...]) -> None:
        if self._calls_store is None:
            raise BackendUnavailableError(
                self._err("check_consistency='digest' needs torch's rendezvous store; use True")
            )
        store, prefix = self._calls_store, self._calls_prefix
        try:
            store.set(f"{prefix}/{sequence}/{self.rank}", " ".join(map(str, call)))
            store.set(f"{prefix}/posted", str(sequence))
            store.add(f"{prefix}/posts", 1)
        except RuntimeError as exc:  # DistNetworkError: the store's host is gone
            raise self._store_lost("digest check", exc) from exc

    def _posted_call(self) -> int | None:
        store, prefix = self._calls_store, self._calls_prefix
        if store is None:
            return None
        try:
            if store.add(f"{prefix}/posts", 0) <= self._posts_seen:
                return None
            return int(store.get(f"{prefix}/posted"))
        except RuntimeError:
            # The store is gone (rank 0, its host, has finished and exited) while this
            # collective still completes: looking for posts is best effort, the wait itself
            # reports a real failure.
            return None

    def _collect_calls(self, sequence: int, call: tuple[int, ...], what: str) -> list[list[int]]:
        store, prefix = self._calls_store, self._calls_prefix
        keys = [f"{prefix}/{sequence}/{r}" for r in range(self.world_size)]
        try:
            self._wait_for_keys(store, keys, what)
            rows = [[int(v) for v in bytes(value).split()] for value in store.multi_get(keys)]
            self._posts_seen += self.world_size
            if store.add(f"{prefix}/{sequence}/collected", 1) == self.world_size:
                for key in [*keys, f"{prefix}/{sequence}/collected"]:
                    store.delete_key(key)
        except CommError:
            raise
        except RuntimeError as exc:  # DistNetworkError: the store's host is gone
            raise self._store_lost(what, exc) from exc
        return rows

    def _wait_for_keys(self, store: Any, keys: list[str], what: str) -> None:
        """Until every rank's call is in the store: at most ``timeout`` seconds, and only
        while the heartbeat names no member that stopped beating or checked out. The
        store's wait returns as soon as the keys are there; it is cut into waits of one
        beat each, and the heartbeat's verdict is asked between two."""
        heartbeat = self._heartbeat
        step = heartbeat.period if heartbeat is not None else self.timeout
        start = time.monotonic()
        with heartbeat.watching() if heartbeat is not None else contextlib.nullcontext():
            while True:
                left = self.timeout - (time.monotonic() - start)
                try:
                    store.wait(keys, datetime.timedelta(seconds=max(0.001, min(step, left))))
                    return
                except dist.DistNetworkError:
                    raise  # the store's host is gone (_collect_calls says so)
                except RuntimeError:  # DistStoreError: this wait's time is up
                    pass
                if time.monotonic() - start >= self.timeout:
                    missing = [r for r, key in enumerate(keys) if not store.check([key])]
                    raise CommTimeoutError(
                        self._err(
                            f"{what}: ranks {missing} did not compare their call within "
                            f"{self.timeout}s.{describe_dead(self.peers, self.rank)}"
                        )
                    )
                silent = heartbeat.verdict(self.peers) if heartbeat is not None else None
                if silent is not None:
                    if self._failed is None:
                        self._failed = f"{what} #{self._sequence}"
                    self._note_failure(silent)
                    raise PeerFailureError(self._err(f"{what}: {silent}. {WHAT_TO_DO}"))

    def _issued(self, work: Any) -> Work:
        _InFlight.issued(work, self.timeout, self.rank)
        return work  # type: ignore[no-any-return]

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return self._issued(dist.all_to_all_single(out, inp, group=self.group, async_op=True))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        if (
            self.backend != "gloo"
            or inp.numel() * inp.element_size() < GLOO_GATHER_BY_BROADCAST_BYTES
            or not out.is_contiguous()
            or self.topology.num_nodes > 1
        ):
            return self._issued(dist.all_gather_single(out, inp, group=self.group, async_op=True))
        # gloo's all-gather receives into a temporary as large as the output, freshly
        # allocated on every call, and copies out of it; a broadcast writes in place. One
        # broadcast per rank into its chunk of ``out`` moves the same bytes and measured
        # 1.0-2.4x less wall time and CPU time (2 and 4 ranks, 256K-4M floats per rank,
        # docs/zero-comm-performance.md). The bits are the input's either way. Within one
        # node only: across nodes the ring puts the fewest bytes on the slow link, and the
        # stats count inter-node bytes in the ring convention.
        n = inp.numel()
        chunks = out.view(self.world_size, n)
        chunks[self.rank].copy_(inp)
        broadcasts = [self._broadcast_untracked(chunks[src], src) for src in range(self.world_size)]
        return self._issued(_AllOf(broadcasts))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self._issued(self._broadcast_untracked(tensor, src))

    def _broadcast_untracked(self, tensor: torch.Tensor, src: int) -> Any:
        """torch's asynchronous broadcast from this group's rank ``src``, not yet held in
        _InFlight (the caller issues it, alone or as part of an _AllOf)."""
        global_src = dist.get_global_rank(self.group, src)
        return dist.broadcast(tensor, global_src, group=self.group, async_op=True)

    def _all_reduce_native(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        return self._issued(dist.all_reduce(tensor, _TORCH_OP[op], group=self.group, async_op=True))

    def _reduce_scatter_native(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> Work:
        return self._issued(
            dist.reduce_scatter_single(out, inp, _TORCH_OP[op], group=self.group, async_op=True)
        )

    def _barrier(self) -> Work:
        # An all-reduce of one element: gloo's own barrier cannot be given a timeout.
        return self._all_reduce_native(torch.zeros(1, device=self.device), ReduceOp.SUM)

    def _prefers_ordered(self, collective: str, dtype: torch.dtype) -> bool:
        # gloo's reduce_scatter is a whole all_reduce underneath; all-to-all plus a local
        # fold moves (N-1)/N of the buffer instead and measured faster
        # (tools/micro/collectives.py).
        return self.backend == "gloo" and collective == "reduce_scatter"

    def _split(self, color: int, key: int) -> Communicator:
        peer = None if self.peers is None else self.peers[self.rank]
        everyone = self.all_gather_object(
            (color, key, dist.get_global_rank(self.group, self.rank), peer)
        )
        # Ties on key go by rank in this (parent) group, as MPI_Comm_split does.
        chosen = sorted(
            (k, parent, g, p) for parent, (c, k, g, p) in enumerate(everyone) if c == color
        )
        members = [global_rank for _, _, global_rank, _ in chosen]
        group = self._new_group(color, members, everyone)
        child = TorchCommunicator(
            group, backend=self.backend, device=self.device, options=self.options
        )
        child.adopted_world = self.adopted_world
        child.parent_ranks = [parent for _, parent, _, _ in chosen]
        if self.peers is not None:
            child.peers = [peer for _, _, _, peer in chosen]
        child._calls_store = self._calls_store
        child._heartbeat = self._heartbeat
        child._calls_prefix = f"{self._calls_prefix}.{self._splits}:{color}"
        self._splits += 1
        return child

    def _new_group(self, color: int, members: list[int], everyone: list[Any]) -> Any:
        """The process group of ``members`` (world ranks, in group order) for ``color``;
        ``everyone``: each rank's (color, key, world rank, peer), by rank here.

        Where every world rank is in this group, each creates every color's group, in
        color order: torch then names them by a count that advances alike on every rank.
        A group made with use_local_synchronization is named by a hash of its ranks and
        of the number of groups this process holds, and that number differs between
        ranks once the application has made a group that some rank is not in (new_group
        gives a non-member nothing): the members would then wait for each other under
        different names until the timeout. Splitting a smaller group still needs local
        synchronisation (the rest of the world takes no part), with that hazard.

        Only an adopted world (``adopted_world``) takes the every-color path: there the
        application owns the process group and may have made groups of its own. A world
        zero_comm made keeps local synchronisation, as before; with every color's group
        made on every rank, c10d's flight recorder held less heap per collective and
        tests/test_heap_growth.py's control (which must show the recorder's growth) no
        longer grew (0.88 MiB a step against 3 needed), so that guard would be lost.
        """
        timeout = datetime.timedelta(seconds=self.timeout)
        if self.world_size < dist.get_world_size() or not self.adopted_world:
            return dist.new_group(
                members,
                timeout=timeout,
                backend=self.backend,
                use_local_synchronization=True,
                sort_ranks=False,
            )
        mine = None
        for each in sorted({c for c, _, _, _ in everyone}):
            ranks = [g for _, _, g, _ in sorted((k, r, g, p) for r, (c, k, g, p)
                                                in enumerate(everyone) if c == each)]  # fmt: skip
            made = dist.new_group(ranks, timeout=timeout, backend=self.backend, sort_ranks=False)
            if each == color:
                mine = made
        return mine

    def close(self) -> None:
        """Collective: every rank of the group must call it.

        Closing the world communicator destroys torch's default process group if zero_comm
        created it (see :class:`_WorldSession`); one the application created is left alone,
        as is any group zero_comm adopted (zero_comm.adopt). Closing a subgroup that
        ``split`` made destroys that subgroup's process group.
        """
        if self.closed:
            return
        if self._diverged is not None or self._failed is not None:
            # Some ranks still have a collective in flight here, or a peer is gone: no
            # barrier can pair up. The process group goes with the world session (at
            # interpreter exit), once the collectives this rank left in flight have ended.
            super().close()
            return
        if not self.owns_group:
            # Adopted (zero_comm.adopt): the group is its creator's; only the heartbeat
            # made for it goes, once every member is done with the group's collectives.
            self.barrier()
            if self._heartbeat is not None:
                self._heartbeat.check_out("it closed zero_comm")
        elif self.group is dist.group.WORLD and dist.is_initialized():
            if _WorldSession.created_here():
                self.barrier()
                _WorldSession.release(self.timeout, "it closed zero_comm")
        elif self.group is not None and dist.is_initialized():
            self.barrier()
            dist.destroy_process_group(self.group)
        super().close()
        # Drop the process group now: a ProcessGroupGloo that lives on into interpreter
        # teardown is destroyed in no particular order with the rest of torch.
        self.group = None


class _WorldSession:
    """The world process group that zero_comm created, and its rendezvous store.

    torch.distributed keeps the default process group in module globals, so this mirrors
    it: one session per process, shared by every world communicator ``init`` returns.

    Destroying the process group while a peer is still inside a collective, rank 0 (which
    hosts the store) leaving before the others have let go of it, or exiting without
    destroying it at all, aborts the process from torch's C++ threads ("terminate called
    without an active exception"). So release lets the collectives still in flight end
    first (:class:`_InFlight`), destroys the group, and rank 0 waits until every other rank
    has checked out of the store (or, on rank 0's host, is no longer running: a dead rank
    uses no store) before dropping it. A session that was never closed is released at
    interpreter exit, with a short wait.

    Each rank's heartbeat (zero_comm.heartbeat) checks out first, at close or at exit, so
    that a peer still waiting in a collective on it names it at once.
    """

    _current: _WorldSession | None = None
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
        _InFlight.settle()
        stuck = session is not None and session.heartbeat is not None and session.heartbeat.named
        if dist.is_initialized() and stuck:
            _keep_groups_for_good()
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
                session.store.add(_check_out_key(session.rank), 1)
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
            if self.store.check([_check_out_key(r) for r in waiting]):
                return
            if time.monotonic() >= next_look:  # which are still out, and alive
                waiting = [
                    r
                    for r in waiting
                    if not self.store.check([_check_out_key(r)]) and not self._died(r)
                ]
                if self.heartbeat is not None:  # stuck or gone: it will not check out
                    waiting = [r for r in waiting if r not in self.heartbeat.named]
                next_look = time.monotonic() + LOOK_FOR_DEAD_S
            time.sleep(0.005)

    def _died(self, rank: int) -> bool:
        peer = self.peers[rank]
        return peer.host == self.peers[0].host and not is_running(peer.pid)


def _keep_groups_for_good() -> None:
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


def _check_out_key(rank: int) -> str:
    return f"{_CLOSE_KEY}/{rank}"


class _AllOf:
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


class _InFlight:
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
        if not cls._exit_hook:  # after _WorldSession's, so it runs before (LIFO)
            cls._exit_hook = True
            atexit.register(cls.settle)
            # Last registered, so first to run: the peers hear that this rank leaves
            # before it waits here for what it left in flight.
            atexit.register(_WorldSession.check_out)
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
