"""The mpi backend, through mpi4py (torch's PyPI wheels have no MPI process group).

Tensors are handed to MPI by address, with no copy: ``MPI.buffer.fromaddress`` on the
tensor's data pointer. Data movement (all-to-all, all-gather, broadcast) is typed as bytes,
so float16 and bfloat16 move like any other dtype. Native reductions exist only for the
types MPI knows (float32, float64, integers); half-precision float SUMs always use the
rank-ordered algorithm, which was bit-exact and faster than a native fp16 MPI_SUM here.

Every operation is non-blocking underneath and waited on with a deadline, so a peer that
never arrives becomes :class:`CommTimeoutError` after ``timeout`` seconds instead of a hang.

A dead peer: MPICH's mpiexec kills every other rank at once (host_watch.py names the dead
one then); with ``mpiexec -disable-auto-cleanup`` it sends the survivors SIGUSR1 instead,
whose default action would end them silently, so a waiting rank raises
:class:`PeerFailureError` naming the dead rank.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from typing import Any

import torch

from .arrival import MeetingPoint
from .c10d_log import quiet_cpp_warnings
from .comm_options import CommOptions
from .communicator import Communicator
from .errors import BackendUnavailableError, CommTimeoutError, PeerFailureError
from .handle import Work
from .heartbeat import WHAT_TO_DO, Heartbeat
from .peers import Peer, describe_dead, this_peer
from .reduce_op import ReduceOp

_TAG_LIMIT = 32768  # MPI guarantees tags up to 32767


class _FailureNotice:
    """Whether the launcher signalled (SIGUSR1) that a process of the job failed."""

    signalled = False

    @classmethod
    def listen(cls) -> None:
        """Take SIGUSR1 where nobody else has (its default action ends the process)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            signal.signal(signal.SIGUSR1, cls._note)

    @classmethod
    def _note(cls, signum: int, frame: object) -> None:
        cls.signalled = True


def import_mpi(rank: int = 0) -> Any:
    """The ``mpi4py.MPI`` module, or :class:`BackendUnavailableError` saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            f"[rank {rank}] backend 'mpi' needs mpi4py: pip install 'zero-comm[mpi]' (and an MPI "
            "library: the site's, or 'pip install mpich'); or use backend='gloo'"
        ) from exc
    return MPI


class MPICommunicator(Communicator):
    """A communicator over an mpi4py intracommunicator (a duplicate of the caller's)."""

    def __init__(
        self,
        mpi_comm: Any,
        *,
        options: CommOptions,
    ) -> None:
        self._MPI = import_mpi()
        self.mpi_comm = mpi_comm
        super().__init__(
            rank=mpi_comm.Get_rank(),
            world_size=mpi_comm.Get_size(),
            backend="mpi",
            device=torch.device("cpu"),
            options=options,
        )
        mpi = self._MPI
        self._typed = {
            torch.float32: mpi.FLOAT,
            torch.float64: mpi.DOUBLE,
            torch.int64: mpi.INT64_T,
            torch.int32: mpi.INT32_T,
            torch.int8: mpi.INT8_T,
            torch.uint8: mpi.UINT8_T,
        }
        self._ops = {ReduceOp.SUM: mpi.SUM, ReduceOp.MAX: mpi.MAX, ReduceOp.MIN: mpi.MIN}
        # The digest check's channel: a communicator of its own, so that no call posted
        # there can ever match a data collective.
        self._calls_comm = mpi_comm.Dup()
        self._call_sends: list[tuple[Any, torch.Tensor]] = []
        # The world's heartbeat (zero_comm.heartbeat), shared by the communicators split
        # from it; None for one rank, or where a rank could not reach its store.
        self._heartbeat: Heartbeat | None = None
        self._meeting_store: Any = None  # a connection to the heartbeat's store, for meet

    @classmethod
    def create_world(cls, options: CommOptions) -> MPICommunicator:
        return cls.adopt(import_mpi().COMM_WORLD, options)

    @classmethod
    def adopt(cls, mpi_comm: Any, options: CommOptions) -> MPICommunicator:
        """Collective over ``mpi_comm`` (an intracommunicator: COMM_WORLD, or the caller's
        own, zero_comm.adopt): a communicator over a duplicate of it, with its peers and,
        for more than one rank, its heartbeat."""
        world = cls(mpi_comm.Dup(), options=options)
        world.peers = [Peer(*p) for p in world.mpi_comm.allgather(tuple(this_peer()))]
        _FailureNotice.listen()
        if world.world_size > 1:
            from .rendezvous import heartbeat_over_mpi

            quiet_cpp_warnings()  # a dead rank 0's store: one line, not c10d's stacks
            world._heartbeat = heartbeat_over_mpi(
                world.mpi_comm, world.rank, world.peers, options.heartbeat_timeout
            )
        return world

    def _bytes(self, tensor: torch.Tensor) -> list[Any]:
        nbytes = tensor.numel() * tensor.element_size()
        return [self._MPI.buffer.fromaddress(tensor.data_ptr(), nbytes), nbytes, self._MPI.BYTE]

    def _typed_buffer(self, tensor: torch.Tensor) -> list[Any]:
        address = self._MPI.buffer.fromaddress(
            tensor.data_ptr(), tensor.numel() * tensor.element_size()
        )
        return [address, tensor.numel(), self._typed[tensor.dtype]]

    def _wait(self, work: Work, name: str) -> None:
        heartbeat = self._heartbeat
        with heartbeat.watching() if heartbeat is not None else contextlib.nullcontext():
            self._poll(work, name, heartbeat)

    def _poll(self, request: Any, name: str, heartbeat: Heartbeat | None) -> None:
        """Until ``request`` (an mpi4py Request) completes; raises where a peer is named
        dead (the launcher's SIGUSR1), stuck or gone (``heartbeat``), or at the timeout."""
        # MPICH advances a non-blocking collective only while a rank is inside an MPI call,
        # so a rank that naps holds the others up (a 1e4-element all_reduce went from
        # 0.04 ms to 0.8 ms with 1 ms naps), while pure spinning starves oversubscribed
        # ranks. So: spin for 1 ms, then poll yielding the core up to 10 ms, then nap 0.1 ms.
        start = time.monotonic()
        polls = 0
        next_beat = heartbeat.period if heartbeat is not None else math.inf
        while not self._test(request, name):
            if _FailureNotice.signalled:
                raise PeerFailureError(
                    self._err(
                        f"{name}: the MPI launcher reported a failed process."
                        + describe_dead(self.peers, self.rank)
                    )
                )
            polls += 1
            if polls % 16:
                continue
            waited = time.monotonic() - start
            if waited > self.timeout:
                raise CommTimeoutError(
                    self._err(
                        f"{name}: no answer from the other ranks within {self.timeout}s; a "
                        "peer is stuck, dead, or called a different collective."
                        + describe_dead(self.peers, self.rank)
                    )
                )
            if heartbeat is not None and waited >= next_beat:
                next_beat = waited + heartbeat.period
                silent = heartbeat.verdict(self.peers)
                if silent is not None and not self._completes_within(request, name, 1.0):
                    raise PeerFailureError(self._err(f"{name}: {silent}. {WHAT_TO_DO}"))
            if waited > 0.002 and polls % 256 == 0:
                self._join_resolution()
            if waited > 0.01:
                time.sleep(1e-4)
            elif waited > 0.001:
                time.sleep(0)

    def _completes_within(self, request: Any, name: str, seconds: float) -> bool:
        """Whether ``request`` completes within ``seconds`` (a peer that checked out may
        have done so right after its part of this very collective)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._test(request, name):
                return True
            time.sleep(1e-3)
        return False

    def _test(self, request: Any, name: str) -> bool:
        """Whether ``request`` completed; an MPI error (a peer's process failed, where
        the MPI library reports it instead of ending the job) becomes PeerFailureError."""
        try:
            return bool(request.Test())
        except self._MPI.Exception as exc:
            raise PeerFailureError(
                self._err(
                    f"{name}: MPI reported an error, most likely a dead peer."
                    f"{describe_dead(self.peers, self.rank)} ({exc})"
                )
            ) from exc

    def _post_call(self, sequence: int, call: tuple[int, ...]) -> None:
        mine = torch.tensor(call, dtype=torch.int64, device="cpu")  # MPI's buffers are host
        for peer in range(self.world_size):
            if peer != self.rank:
                request = self._calls_comm.Isend(
                    self._typed_buffer(mine), dest=peer, tag=sequence % _TAG_LIMIT
                )
                self._call_sends.append((request, mine))

    def _posted_call(self) -> int | None:
        status = self._MPI.Status()
        try:
            if not self._calls_comm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG, status):
                return None
        except self._MPI.Exception:
            return None  # best effort (a peer has gone): the wait itself reports failures
        tag = status.Get_tag()
        return next((s for s in self._schedule.predicted if s % _TAG_LIMIT == tag), None)

    def _collect_calls(self, sequence: int, call: tuple[int, ...], what: str) -> list[list[int]]:
        rows = torch.zeros(self.world_size, len(call), dtype=torch.int64, device="cpu")
        rows[self.rank] = torch.tensor(call, device="cpu")
        for peer in range(self.world_size):
            if peer != self.rank:
                request = self._calls_comm.Irecv(
                    self._typed_buffer(rows[peer]), source=peer, tag=sequence % _TAG_LIMIT
                )
                self._wait(request, what)
        for request, _ in self._call_sends:
            self._wait(request, what)
        self._call_sends.clear()
        return rows.tolist()

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        chunk_bytes = inp.numel() * inp.element_size() // self.world_size
        send = [self._bytes(inp)[0], chunk_bytes, self._MPI.BYTE]
        recv = [self._bytes(out)[0], chunk_bytes, self._MPI.BYTE]
        return PinnedRequest(self.mpi_comm.Ialltoall(send, recv), out, inp)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        chunk_bytes = inp.numel() * inp.element_size()
        recv = [self._bytes(out)[0], chunk_bytes, self._MPI.BYTE]
        return PinnedRequest(self.mpi_comm.Iallgather(self._bytes(inp), recv), out, inp)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return PinnedRequest(self.mpi_comm.Ibcast(self._bytes(tensor), root=src), tensor)

    def _all_reduce_native(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        request = self.mpi_comm.Iallreduce(
            self._MPI.IN_PLACE, self._typed_buffer(tensor), self._ops[op]
        )
        return PinnedRequest(request, tensor)

    def _reduce_scatter_native(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> Work:
        # The send side is given without a count: mpi4py reads the block count from recv.
        send = self._typed_buffer(inp)
        request = self.mpi_comm.Ireduce_scatter_block(
            [send[0], send[2]], self._typed_buffer(out), self._ops[op]
        )
        return PinnedRequest(request, out, inp)

    def _prefers_ordered(self, collective: str, dtype: torch.dtype) -> bool:
        # MPI has no bfloat16, and its float16 SUM was 20x slower than the ordered fold.
        return dtype not in self._typed

    def _barrier(self) -> Work:
        return self.mpi_comm.Ibarrier()  # type: ignore[no-any-return]

    def _split(self, color: int, key: int) -> Communicator:
        child = MPICommunicator(self.mpi_comm.Split(color, key), options=self.options)
        members = child.mpi_comm.allgather((tuple(this_peer()), self.rank))
        child.peers = [Peer(*peer) for peer, _ in members]
        child.parent_ranks = [parent for _, parent in members]
        child._heartbeat = self._heartbeat
        return child

    def shared_memory_node_key(self) -> int:
        """Collective over this communicator: the lowest rank of it that shares memory with
        this process (``MPI_Comm_split_type(COMM_TYPE_SHARED)``: the ranks of one node)."""
        shared = self.mpi_comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return int(shared.allreduce(self.rank, op=self._MPI.MIN))
        finally:
            shared.Free()

    def _meeting_point(self) -> MeetingPoint | None:
        """The world meets in its heartbeat's store (a connection of its own); a split
        group, or a job without that store, does not meet (Communicator.meet)."""
        if self._heartbeat is None or self.parent_ranks is not None:
            return None
        if self._meeting_store is None:
            from .rendezvous import store_at

            self._meeting_store = store_at(self._heartbeat.store_address, self.timeout)
        return MeetingPoint(self._meeting_store, "meet/world", self.peers, self._heartbeat)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self.parent_ranks is None and self._heartbeat is not None:
            self._heartbeat.check_out("it closed zero_comm")
        if self.mpi_comm is not None and not self._MPI.Is_finalized():
            self.mpi_comm.Free()
            self._calls_comm.Free()
            self.mpi_comm = None


class PinnedRequest:
    """An MPI request and the tensors its buffers point into. mpi4py's buffers here are raw
    addresses (``buffer.fromaddress``) that own nothing, so a tensor the caller drops (a
    temporary send buffer, say) would be freed while MPI still reads or writes it; the
    request keeps them until it is waited for, as a gloo or nccl work does."""

    __slots__ = ("request", "tensors")

    def __init__(self, request: Any, *tensors: torch.Tensor) -> None:
        self.request = request
        self.tensors = tensors

    def Test(self) -> bool:  # mpi4py's name, which _wait calls
        done = bool(self.request.Test())
        if done:
            self.tensors = ()
        return done

    def wait(self) -> None:
        self.request.Wait()


def mpi_world_check(rank: int) -> None:
    """Raise if mpi4py's world disagrees with the launcher about this process's rank."""
    mpi = import_mpi(rank)
    if mpi.COMM_WORLD.Get_rank() != rank:
        raise BackendUnavailableError(
            f"[rank {rank}] mpi4py says this is rank {mpi.COMM_WORLD.Get_rank()}; the launcher's "
            "MPI and mpi4py's MPI library differ (set MPI4PY_LIBMPI to the launcher's libmpi)"
        )
