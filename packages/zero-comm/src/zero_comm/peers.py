"""Which process each rank is, so that a surviving rank can name the one that died.

At start-up every rank records ``(host, pid)``: gloo and nccl in their rendezvous check-in,
MPI by an allgather. When a collective fails (a peer closed its connection, or the timeout
passed), the communicator looks at the ranks on its own host: a pid that no longer exists,
or a zombie (killed, not yet reaped by its launcher), is a dead rank, and a process in the
stopped state a stopped one; the error names them. Ranks on other hosts cannot be checked
from here; the error says so.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import NamedTuple


class Peer(NamedTuple):
    host: str
    pid: int

    def encode(self) -> str:
        return f"{self.pid} {self.host}"

    @classmethod
    def decode(cls, text: str) -> Peer:
        pid, host = text.split(" ", 1)
        return cls(host, int(pid))


def this_peer() -> Peer:
    return Peer(socket.gethostname(), os.getpid())


def _state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (R, S, T, Z, ...); None if unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_running(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (a zombie is not)."""
    state = _state(pid)
    if state is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` of this host is stopped (SIGSTOP, Ctrl-Z, a debugger):
    alive, but it will answer no collective until it is continued."""
    return _state(pid) in ("T", "t")


def stopped_ranks(peers: list[Peer], me: int) -> list[int]:
    """The ranks on this host whose process is stopped."""
    here = peers[me].host
    return [r for r, p in enumerate(peers) if r != me and p.host == here and is_stopped(p.pid)]


def dead_ranks(peers: list[Peer], me: int) -> tuple[list[int], list[int]]:
    """(ranks on this host whose process is gone, ranks on other hosts: unknown)."""
    here = peers[me].host
    dead = [r for r, p in enumerate(peers) if r != me and p.host == here and not is_running(p.pid)]
    elsewhere = [r for r, p in enumerate(peers) if p.host != here]
    return dead, elsewhere


def describe_dead(
    peers: list[Peer] | None, me: int, settle_s: float = 1.0, exclude: set[int] | None = None
) -> str:
    """A sentence naming the dead ranks, for an error message ("" if none is known);
    ``exclude``: ranks not to name (those that checked out: they left, they did not die).

    A peer's connection closes while its process is still exiting, so a rank that sees
    no dead peer looks again for up to ``settle_s`` seconds."""
    if not peers:
        return ""
    skip = exclude or set()

    def found() -> tuple[list[int], list[int]]:
        dead, elsewhere = dead_ranks(peers, me)
        return [r for r in dead if r not in skip], elsewhere

    deadline = time.monotonic() + settle_s
    dead, elsewhere = found()
    while not dead and time.monotonic() < deadline:
        time.sleep(0.02)
        dead, elsewhere = found()
    parts = []
    if dead:
        named = ", ".join(f"rank {r} (pid {peers[r].pid})" for r in dead)
        parts.append(f"{named} {'is' if len(dead) == 1 else 'are'} dead")
    stopped = stopped_ranks(peers, me)
    if stopped:
        named = ", ".join(f"rank {r} (pid {peers[r].pid})" for r in stopped)
        verb = "is" if len(stopped) == 1 else "are"
        parts.append(f"{named} {verb} stopped (SIGSTOP or Ctrl-Z: kill -CONT to go on)")
    if elsewhere:
        parts.append(f"ranks {elsewhere} on other hosts could not be checked")
    if not parts:
        return " Every rank on this host is still running."
    return " " + "; ".join(parts) + "."
