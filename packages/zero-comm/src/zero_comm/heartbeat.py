"""Each rank's heartbeat in the rendezvous store, so that a waiting rank names a stuck or
departed peer in seconds instead of after the collective timeout.

A stopped peer (SIGSTOP, Ctrl-Z), one swapped out, or one hung in C code holding the GIL
keeps its connections open: a collective waiting on it ends only by its timeout (300 s by
default), and a peer on another host cannot be looked at in /proc. A peer that exited
cleanly (its script returned, or closed zero_comm) while the others wait in a collective
is no different for gloo. So every rank runs a daemon thread, with a store connection of
its own (it never waits behind a collective's store traffic, nor makes one wait; gloo
and nccl: the rendezvous store; mpi: one rank 0 opens for it, rendezvous.heartbeat_over_mpi)::

    every `period` s     add 1 to heartbeat/beat/<rank>             (its beat counter)
    while a collective   multi_get every peer's counter, and note the time
      waits on this rank   each counter was first seen at its value
    at close or exit     set heartbeat/left/<rank> to how it ended,  (its check-out)
                         add LEFT to heartbeat/beat/<rank>

and a rank waiting in a collective asks :meth:`Heartbeat.verdict` (no store round trip:
the thread's last reading) about the collective's members, polling every ``period``:

    a counter >= LEFT                      the peer checked out: named at once
    a peer of this host whose process is   it died without checking out (SIGKILL, the
      gone (/proc)                           kernel's OOM killer, os._exit): named at once
    a counter unchanged over readings      the peer has not beaten for that long: named as
      more than heartbeat_timeout apart      stopped (/proc, on this host) or not beating
    the store gives no answer for longer   rank 0, which hosts it, is stopped or hung
      than heartbeat_timeout
    the store's connection fails           rank 0 is gone (its death)

A counter is compared only with itself, read by one rank, so no clocks are compared across
hosts; and a reading gap (this rank itself stopped) cannot make a beating peer look stale:
a peer that beat in between shows a new value. A slow collective whose peers all beat
waits up to the collective timeout, as before: the heartbeat only ever names a peer that
has not beaten for ``heartbeat_timeout``, checked out, or (on this host) is gone. A peer
whose beat thread cannot run for that long (a C call holding the GIL) is named as not
beating: for its peers it is hung.

Cost: one store ``add`` per rank per period (at most 2 s); the peers' counters are read
only while a collective has been waiting on this rank for a period or more.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from .peers import Peer, is_running, is_stopped

# What a rank that met a stuck or departed peer can do (the end of its error's line).
WHAT_TO_DO = (
    "The job cannot go on without it: end every rank (the launcher's Ctrl-C, or kill), see "
    "that rank's log for why it stopped, and resume from the last checkpoint"
)
LEFT = 1 << 40  # added to a beat counter at check-out: larger than any count of beats
BEATS_PER_TIMEOUT = 10
MAX_PERIOD_S = 2.0
MIN_PERIOD_S = 0.05


def beat_key(rank: int) -> str:
    return f"heartbeat/beat/{rank}"


def left_key(rank: int) -> str:
    return f"heartbeat/left/{rank}"


def first_beat(store: Any, rank: int) -> None:
    """Create ``rank``'s counter (the rendezvous calls this before the rank checks in, so
    every counter exists once the rendezvous completes)."""
    store.add(beat_key(rank), 1)


def period_for(heartbeat_timeout: float) -> float:
    """Seconds between two beats (and two readings) for a given heartbeat timeout."""
    return min(MAX_PERIOD_S, max(MIN_PERIOD_S, heartbeat_timeout / BEATS_PER_TIMEOUT))


def describe_peer(rank: int, peer: Peer) -> str:
    return f"rank {rank} (host {peer.host}, pid {peer.pid})"


class Heartbeat:
    """This rank's beat and its view of its peers' beats (one per world: see module doc).

    ``connect`` makes a store client of the thread's own (PrefixStore over the rendezvous
    TCPStore, with ``heartbeat_timeout`` as its timeout); ``peers``: every rank's (host,
    pid), by world rank; ``store_address``: "host:port" of the store rank 0 hosts.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        *,
        rank: int,
        peers: list[Peer],
        heartbeat_timeout: float,
        store_address: str,
    ) -> None:
        self.rank = rank
        self.peers = peers
        self.timeout = heartbeat_timeout
        self.period = period_for(heartbeat_timeout)
        self.store_address = store_address
        self._connect = connect
        self._store: Any = None
        self._lock = threading.Lock()  # the store connection: the thread's, and check_out's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._waiting = 0  # collectives of this process now waiting (watching)
        # rank -> (counter, the time of the first reading with that value)
        self._seen: dict[int, tuple[int, float]] = {}
        self._read_at = 0.0  # the last reading's time
        self._left: dict[int, str] = {}  # rank -> how it ended, once checked out
        self._asking_since: float | None = None  # a store call not answered yet
        self._store_error: str | None = None  # the store's connection failed
        self._store_silent: float | None = None  # its call timed out after this long
        # What check_out says at interpreter exit; a failure met or raised sets it.
        self.ending = "its script ended"
        self.checked_out = False
        self.named: set[int] = set()  # ranks a verdict named: nobody waits for them again

    # --------------------------------------------------------------- this rank
    def start(self) -> None:
        """Connect and start beating; at interpreter exit, check out."""
        self._store = self._connect()
        self._thread = threading.Thread(target=self._run, name="zero-comm-heartbeat", daemon=True)
        self._thread.start()
        previous_hook = sys.excepthook

        def note_uncaught(
            kind: type[BaseException], value: BaseException, tb: TracebackType | None
        ) -> None:
            self.ending = f"it raised an uncaught {kind.__name__}"
            previous_hook(kind, value, tb)

        sys.excepthook = note_uncaught
        atexit.register(self.check_out)

    def left_ranks(self) -> set[int]:
        """The ranks whose check-out this rank has read (they left; they did not die)."""
        return set(self._left)

    def left_how(self, rank: int) -> str:
        """How ``rank`` ended, as its check-out said ("" if not read)."""
        return self._left.get(rank, "")

    def check_out(self, how: str | None = None) -> None:
        """Tell the peers this rank takes part in no more collectives (``how``: why, for
        their message), and stop beating. At most once; never raises."""
        if self.checked_out or self._store is None:
            return
        self.checked_out = True
        self._stop.set()
        # Not behind a reading that hangs on a stopped store (its timeout would be waited).
        if not self._lock.acquire(timeout=self.period + 1.0):
            return
        try:
            self._store.set(left_key(self.rank), how or self.ending)
            self._store.add(beat_key(self.rank), LEFT)
        except RuntimeError:  # the store is gone (rank 0 ended): nobody is left to tell
            pass
        finally:
            self._lock.release()

    def stop(self) -> None:
        """Stop beating without checking out (the store is about to go)."""
        self._stop.set()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """While a collective waits: read the peers' counters on every beat."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if not self._tick(beat=True, read=self._waiting > 0):
                return  # its connection is broken: no more beats

    def read_now(self) -> None:
        """Read the peers' counters now, on the caller's thread (a rank whose collective
        failed: a peer that checked out is then named as having left, not as dead). Not
        while a call of the thread's is unanswered: it would wait for its timeout."""
        if self._store is None or self._asking_since is not None or self._store_error:
            return
        if self._lock.acquire(timeout=self.period):
            self._lock.release()
            self._tick(beat=False, read=True)

    def _tick(self, *, beat: bool, read: bool) -> bool:
        """Beat and/or read the peers' counters; False once the store has failed."""
        others = [r for r in range(len(self.peers)) if r != self.rank]
        values: list[int] | None = None
        with self._lock:
            if self._stop.is_set() and beat:
                return False
            asked = self._asking_since = time.monotonic()
            try:
                if beat:
                    self._store.add(beat_key(self.rank), 1)
                if read and others:
                    keys = [beat_key(r) for r in others]
                    values = [int(v) for v in self._store.multi_get(keys)]
                    for r, value in zip(others, values, strict=True):
                        if value >= LEFT and r not in self._left:
                            self._left[r] = bytes(self._store.get(left_key(r))).decode()
            except RuntimeError as exc:  # DistNetworkError, DistStoreError (a timeout)
                if any(word in str(exc).lower() for word in ("timeout", "timed out")):
                    self._store_silent = time.monotonic() - asked
                else:
                    self._store_error = str(exc).strip().splitlines()[0]
                return False
            finally:
                self._asking_since = None
        if values is not None:
            now = time.monotonic()
            for r, value in zip(others, values, strict=True):
                seen = self._seen.get(r)
                if seen is None or seen[0] != value:
                    self._seen[r] = (value, now)
            self._read_at = now
        return True

    # ------------------------------------------------------------- the verdict
    def verdict(self, members: list[Peer] | None = None) -> str | None:
        """A sentence naming the peers among ``members`` (None: every rank) that checked
        out or have not beaten for ``heartbeat_timeout``, or the store rank 0 hosts that
        stopped answering; None while every one of them beats."""
        ranks = [
            r
            for r, p in enumerate(self.peers)
            if r != self.rank and (members is None or p in members)
        ]
        if self._store_error is not None and self.rank != 0:
            return self.store_lost(self._store_error)
        asking, silent = self._asking_since, self._store_silent
        if asking is not None and time.monotonic() - asking > self.timeout:
            silent = time.monotonic() - asking
        if silent is not None and self.rank != 0:
            return (
                f"the rendezvous store that {describe_peer(0, self.peers[0])} hosts at "
                f"{self.store_address} has not answered for {silent:.1f} s (heartbeat_timeout "
                f"{self.timeout:g} s): {self._why_silent(0)}"
            )
        dead = self._dead_here(ranks)
        if any(r not in self._left for r in dead):
            self.read_now()  # it may have checked out as it ended: then it left
            if self._store_error is not None and self.rank != 0:
                return self.store_lost(self._store_error)
        left = [r for r in ranks if r in self._left]
        if left:
            self.named.update(left)
            return "; ".join(
                f"{describe_peer(r, self.peers[r])} left the job ({self._left[r]}) and will "
                "join no more collectives"
                for r in left
            )
        if dead:
            self.named.update(dead)
            return "; ".join(
                f"{describe_peer(r, self.peers[r])} is dead: its process ended without "
                "leaving the job (killed, by the kernel's out-of-memory killer or a signal, "
                "or ended at once by a fatal error)"
                for r in dead
            )
        stale = [
            (r, self._read_at - self._seen[r][1])
            for r in ranks
            if r in self._seen and self._read_at - self._seen[r][1] > self.timeout
        ]
        if stale:
            self.named.update(r for r, _ in stale)
            return "; ".join(
                f"{describe_peer(r, self.peers[r])} has sent no heartbeat for {silent:.1f} s "
                f"(heartbeat_timeout {self.timeout:g} s): {self._why_silent(r)}"
                for r, silent in stale
            )
        return None

    def _dead_here(self, ranks: list[int]) -> list[int]:
        """The ranks among ``ranks`` on this host whose process is gone (/proc): named at
        once, not after ``heartbeat_timeout`` (a store that outlives them keeps their
        counters, unchanged; a collective of the digest check waits on the store only)."""
        here = self.peers[self.rank].host
        return [
            r for r in ranks if self.peers[r].host == here and not is_running(self.peers[r].pid)
        ]

    def verdict_within_beats(self, members: list[Peer] | None, beats: int) -> str | None:
        """:meth:`verdict`, waiting up to ``beats`` beats for one (a peer that exited
        cleanly checked out before its connections closed, but this rank may not have
        read it yet); None where the heartbeat has nothing to say by then."""
        deadline = time.monotonic() + beats * self.period + 0.1
        with self.watching():
            while (said := self.verdict(members)) is None:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)
        return said

    def store_lost(self, error: str) -> str:
        """The sentence for a store call that failed with ``error`` (its first line):
        rank 0, which hosts the store, is dead (on this host, by /proc) or gone."""
        here = self.peers[0].host == self.peers[self.rank].host
        dead = here and not is_running(self.peers[0].pid)
        deadline = time.monotonic() + 1.0  # its connections close while it is exiting
        while here and not dead and time.monotonic() < deadline:
            time.sleep(0.02)
            dead = not is_running(self.peers[0].pid)
        gone = "is dead" if dead else "is gone"
        return (
            f"{describe_peer(0, self.peers[0])} {gone}: the rendezvous store it hosted at "
            f"{self.store_address} closed its connection ({error})"
        )

    def _why_silent(self, rank: int) -> str:
        peer = self.peers[rank]
        if peer.host == self.peers[self.rank].host and is_stopped(peer.pid):
            return f"it is stopped (SIGSTOP or Ctrl-Z: kill -CONT {peer.pid} to go on)"
        return "it is stopped, swapped out, or hung in C code holding the GIL"


def store_host_note(heartbeat: Heartbeat | None, members: list[Peer] | None) -> str:
    """ " Rank 0 hosted the rendezvous store at ADDRESS." where rank 0 is a member of the
    failed group and not known to be running ("" otherwise): its death took the store."""
    if heartbeat is None or members is None or heartbeat.peers[0] not in members:
        return ""
    rank_0, here = heartbeat.peers[0], heartbeat.peers[heartbeat.rank]
    if rank_0.host == here.host and is_running(rank_0.pid):
        return ""
    return f" Rank 0 hosted the rendezvous store at {heartbeat.store_address}."
