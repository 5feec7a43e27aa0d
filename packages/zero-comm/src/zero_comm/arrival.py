"""A labelled meeting point: before a collective that user code may call on some ranks
only (``engine.save``), every rank says where it is, and a rank that waits names the
peers that are not coming, in seconds, instead of waiting out the collective timeout.

    rank r:   n = add meet/<r>/count 1            (its own count of meetings: no state here)
              set meet/<n>/<r> = label            ("engine.save()")
              wait for meet/<n>/<every rank>,     a beat at a time; between two beats:
                a member that checked out            -> "left the job ... without calling"
                a member that stopped beating        -> named as the heartbeat names it
                a member of this host that is gone   -> "is dead ... never called" (/proc)
                ``within`` seconds gone, and a member
                  that beats has not come            -> "is elsewhere" (alive, not here)
              the labels differ                    -> each rank's label named
              the last rank out deletes the keys

A slow rank that is alive and beating is waited for up to ``within`` seconds (by default
the collective timeout, what the collective itself would wait: a save after a long rank-0
evaluation still meets, as it did before the meeting existed); after WARN_AFTER_S (60) of
waiting for a live rank, the waiting rank warns once, naming it. A rank that returned
from its script is named as soon as its check-out is read (one heartbeat period, at
most 2 s). The cost where every
rank comes: five store round trips per rank and the last one's deletes, about a
millisecond on one host (tools' figures in the branch note).

Where there is no store (simulated ranks, an MPI job whose heartbeat store could not be
reached, one rank) :meth:`Communicator.meet` does nothing: the collective that follows
waits as any collective does (MPI: its polling names a peer that checked out, or a dead
one of this host, as the collectives do).
"""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from typing import Any, NamedTuple

from .errors import CollectiveMismatchError, CommTimeoutError, PeerFailureError
from .heartbeat import WHAT_TO_DO, Heartbeat, describe_peer
from .peers import Peer, is_running

WARN_AFTER_S = 60.0  # waiting this long for a live rank is said once, naming it
POLL_WITHOUT_HEARTBEAT_S = 0.5  # between two looks where no heartbeat thread reads


class MeetingPoint(NamedTuple):
    """What a communicator meets through: a store client every member reaches, a key
    prefix of this group's own, its members' (host, pid) by group rank (None: unknown),
    and the world's heartbeat (None: none)."""

    store: Any
    prefix: str
    peers: list[Peer] | None
    heartbeat: Heartbeat | None


def meet(
    point: MeetingPoint, rank: int, world_size: int, label: str, within: float, longer: str
) -> None:
    """Collective over the ``world_size`` members: return once every member has called
    ``meet`` with this ``label``; raise naming the members that are not coming (see the
    module doc). Errors carry ``[rank R]`` and start with ``label``; ``longer`` names how
    the caller gives a slow rank more than ``within`` seconds."""
    store, prefix = point.store, point.prefix
    sequence = int(store.add(f"{prefix}/{rank}/count", 1))
    keys = [f"{prefix}/{sequence}/{r}" for r in range(world_size)]
    store.set(keys[rank], label)
    _wait_for_everyone(point, rank, keys, label, within, longer)
    labels = [bytes(value).decode() for value in store.multi_get(keys)]
    if store.add(f"{prefix}/{sequence}/out", 1) == world_size:
        for key in [*keys, f"{prefix}/{sequence}/out"]:
            store.delete_key(key)
    if any(other != label for other in labels):
        named = "; ".join(f"rank {r}: {other}" for r, other in enumerate(labels))
        raise CollectiveMismatchError(
            f"[rank {rank}] {label}: the ranks are at different calls ({named}); every rank "
            "must make the same collective calls in the same order"
        )


def _wait_for_everyone(
    point: MeetingPoint, rank: int, keys: list[str], label: str, within: float, longer: str
) -> None:
    store, heartbeat = point.store, point.heartbeat
    step = heartbeat.period if heartbeat is not None else POLL_WITHOUT_HEARTBEAT_S
    start = time.monotonic()
    warned = within <= WARN_AFTER_S  # an error comes first anyway
    with heartbeat.watching() if heartbeat is not None else contextlib.nullcontext():
        while True:
            left = within - (time.monotonic() - start)
            try:
                store.wait(keys, datetime.timedelta(seconds=max(0.001, min(step, left))))
                return
            except RuntimeError as exc:  # DistStoreError: this wait's time is up
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise  # the store's host is gone: the caller's collective names it
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:
                return
            said = _not_coming(point, rank, missing, label)
            if said is not None:
                raise PeerFailureError(f"[rank {rank}] {said}")
            waited = time.monotonic() - start
            if waited >= within:
                said = _elsewhere(point, missing, label, within, longer)
                raise CommTimeoutError(f"[rank {rank}] {said}")
            if not warned and waited >= WARN_AFTER_S:
                warned = True
                who = ", ".join(f"rank {r}" for r in missing)
                warnings.warn(
                    f"[rank {rank}] {label}: waiting {waited:.0f} s for {who}, alive but not "
                    f"in {label} yet; waiting up to {within:g} s in all (call {label} on "
                    "every rank)",
                    RuntimeWarning,
                    stacklevel=2,
                )


def _not_coming(point: MeetingPoint, rank: int, missing: list[int], label: str) -> str | None:
    """A sentence naming the missing members known not to be coming, or None."""
    peers, heartbeat = point.peers, point.heartbeat
    if peers is None:
        return None
    sentences: list[str] = []
    checked_out = False  # a script that ended without the call: the fix is in the script
    if heartbeat is not None:
        left = heartbeat.left_ranks()
        for r in missing:
            world = _world_rank(heartbeat, peers[r])
            if world in left:
                checked_out = True
                sentences.append(
                    f"{describe_peer(world, peers[r])} left the job "
                    f"({heartbeat.left_how(world)}) without calling {label}"
                )
        if not sentences:
            members = [peers[r] for r in missing]
            silent = heartbeat.verdict(members)
            if silent is not None:
                return f"{label}: {silent}; it has not called {label}"
    here = peers[rank].host
    for r in missing:
        gone = peers[r].host == here and not is_running(peers[r].pid)
        if gone and not any(f"rank {r} " in s for s in sentences):
            # gone without a check-out: killed or crashed, as peers.describe_dead says it
            sentences.append(
                f"rank {r} (pid {peers[r].pid}) is dead (it ended without checking out: "
                f"killed or crashed) and never called {label}"
            )
    if not sentences:
        return None
    fix = (
        f"{label} is collective: call it on every rank (a save under `if rank == 0:` alone "
        "never completes)"
        if checked_out
        else WHAT_TO_DO
    )
    return f"{label}: " + "; ".join(sentences) + f". {fix}"


def _elsewhere(
    point: MeetingPoint, missing: list[int], label: str, within: float, longer: str
) -> str:
    heartbeat, peers = point.heartbeat, point.peers
    who = ", ".join(
        describe_peer(_world_rank(heartbeat, peers[r]) if heartbeat else r, peers[r])
        if peers is not None
        else f"rank {r}"
        for r in missing
    )
    they, are = ("it", "is") if len(missing) == 1 else ("they", "are")
    alive = f"{they} beat, so {they} {are} alive and" if heartbeat else f"{they} may be"
    return (
        f"{label}: {who} did not call {label} within {within:g} s; {alive} elsewhere (still "
        f"training, waiting in another collective, or the script calls {label} on some ranks "
        f"only). Call {label} on every rank; a rank that is only slow (an evaluation on "
        f"rank 0 first) can be given longer: {longer}"
    )


def _world_rank(heartbeat: Heartbeat, peer: Peer) -> int:
    return heartbeat.peers.index(peer)
