"""How the ranks of a gloo or nccl world find each other.

Rank 0 hosts a TCP key-value store; the others connect to it. The store's address comes
from, in order: MASTER_ADDR/MASTER_PORT (torchrun, zero-launch, or the user), SLURM's node
list (see launcher_env), or, under an MPI launcher, rank 0 opening the store on a free port
and broadcasting its address over mpi4py. Every rank then checks in, and rank 0 waits for
all of them, so that a rank that never starts is named instead of waited for forever.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from typing import Any

from torch.distributed import HashStore, PrefixStore, TCPStore  # type: ignore[attr-defined]

from .errors import BackendUnavailableError, CommTimeoutError
from .heartbeat import Heartbeat, first_beat
from .launcher_env import LaunchEnv
from .peers import Peer, this_peer

_PREFIX = "zero_comm/rendezvous"
log = logging.getLogger(__name__)


def _own_address() -> str:
    """An address of this host that the other hosts of the job can reach."""
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostname()


# How long a rank tries to open a TCP connection to the heartbeat store before the job goes
# on without one: an address of rank 0's host that this rank cannot reach (a name that
# resolves to the loopback, a host in another network namespace) would otherwise hold every
# rank's start-up for the store's whole timeout.
REACH_TIMEOUT_S = 3.0


def _reachable(host: str, port: int) -> None:
    """Raise OSError unless a TCP connection to ``host``:``port`` opens within
    REACH_TIMEOUT_S seconds."""
    with socket.create_connection((host, port), timeout=REACH_TIMEOUT_S):
        pass


def _address_over_mpi(env: LaunchEnv, timeout: float) -> tuple[str, int, Any]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            f"[rank {env.rank}] started by {env.launcher} without MASTER_ADDR/MASTER_PORT: "
            "install mpi4py (pip install 'zero-comm[mpi]') so rank 0 can share its address, "
            "or export MASTER_ADDR and MASTER_PORT to every rank"
        ) from exc
    store = None
    address: tuple[str, int] | None = None
    if env.rank == 0:
        store = TCPStore(
            "0.0.0.0",
            0,
            env.world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        address = (_own_address(), store.port)
    address = MPI.COMM_WORLD.bcast(address, root=0)
    assert address is not None
    return address[0], address[1], store


def rendezvous_store(env: LaunchEnv, timeout: float) -> Any:
    """A store shared by all ranks of the world described by ``env``.

    Raises :class:`CommTimeoutError` naming the ranks that did not check in within
    ``timeout`` seconds.
    """
    if env.world_size == 1:
        return HashStore()
    store = None
    if env.master_addr is not None and env.master_port is not None:
        addr, port = env.master_addr, env.master_port
    elif env.under_mpi_launcher:
        addr, port, store = _address_over_mpi(env, timeout)
    else:
        raise BackendUnavailableError(
            f"[rank {env.rank}] the {env.launcher} launcher did not say where rank 0 is: "
            "export MASTER_ADDR and MASTER_PORT to every rank"
        )
    if store is None:
        try:
            store = TCPStore(
                addr,
                port,
                env.world_size,
                is_master=env.rank == 0,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            role = "open" if env.rank == 0 else "reach"
            raise CommTimeoutError(
                f"[rank {env.rank}] could not {role} the rendezvous store at {addr}:{port} "
                f"within {timeout}s ({exc}); check that rank 0 is running and that "
                "MASTER_ADDR/MASTER_PORT are right and reachable"
            ) from exc
    _check_in(store, env, timeout)
    return PrefixStore("zero_comm", store)


def store_address(store: Any) -> str:
    """ "host:port" of the TCPStore under ``store`` (what rendezvous_store gave)."""
    tcp = store.underlying_store
    return f"{tcp.host}:{tcp.port}"


def store_client(store: Any, timeout: float) -> Any:
    """A connection of its own to the TCPStore under ``store`` (what rendezvous_store
    gave), with the same prefix; its calls wait at most ``timeout`` seconds."""
    tcp = store.underlying_store
    client = TCPStore(
        tcp.host,
        tcp.port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return PrefixStore("zero_comm", client)


def store_at(address: str, timeout: float) -> Any:
    """A client of the TCPStore at ``address`` ("host:port", a heartbeat's store), under
    the prefix every client of ours uses; its calls wait at most ``timeout`` seconds."""
    host, port = address.rsplit(":", 1)
    client = TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return PrefixStore("zero_comm", client)


def read_peers(store: Any, world_size: int) -> list[Peer]:
    """Every rank's (host, pid), as checked in (``store``: what rendezvous_store gave)."""
    if world_size == 1:
        return [this_peer()]
    return [Peer.decode(store.get(f"rendezvous/arrived/{r}").decode()) for r in range(world_size)]


def _check_in(store: Any, env: LaunchEnv, timeout: float) -> None:
    store.set(f"{_PREFIX}/arrived/{env.rank}", this_peer().encode())
    first_beat(PrefixStore("zero_comm", store), env.rank)
    store.add(f"{_PREFIX}/count", 1)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while store.add(f"{_PREFIX}/count", 0) < env.world_size:
        if time.monotonic() > deadline:
            missing = [
                r for r in range(env.world_size) if not store.check([f"{_PREFIX}/arrived/{r}"])
            ]
            raise CommTimeoutError(
                f"[rank {env.rank}] rendezvous: ranks {missing} of {env.world_size} did not "
                f"arrive within {timeout}s; check that all {env.world_size} ranks were launched "
                "(WORLD_SIZE or -n) and that they could start"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def heartbeat_over_mpi(
    mpi_comm: Any, rank: int, peers: list[Peer], heartbeat_timeout: float
) -> Heartbeat | None:
    """Collective over ``mpi_comm`` (a world): the heartbeat of an MPI job, in a store that
    rank 0 opens on a free port and whose address it broadcasts, as the gloo rendezvous
    does under an MPI launcher. None on every rank where some rank could not reach it
    (the job then runs without: a stuck peer waits out the collective timeout)."""
    from mpi4py import MPI

    master = None
    address: tuple[str, int] | None = None
    if rank == 0:
        try:
            master = TCPStore(
                "0.0.0.0",
                0,
                is_master=True,
                timeout=datetime.timedelta(seconds=heartbeat_timeout),
                wait_for_workers=False,
            )
            address = (_own_address(), master.port)
        except (RuntimeError, OSError) as exc:
            log.warning("zero_comm: [rank 0] no heartbeat store (%s)", exc)
    address = mpi_comm.bcast(address, root=0)
    if address is None:
        return None
    host, port = address
    client = None
    try:
        _reachable(host, port)  # seconds, not the store's own heartbeat_timeout to connect
        client = PrefixStore(
            "zero_comm",
            TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=heartbeat_timeout),
                wait_for_workers=False,
            ),
        )
        first_beat(client, rank)
    except (RuntimeError, OSError) as exc:
        log.warning("zero_comm: [rank %d] cannot reach the heartbeat store (%s)", rank, exc)
        client = None
    if not mpi_comm.allreduce(client is not None, op=MPI.LAND):
        return None  # every counter exists from here (the all-reduce comes after each)

    def connect() -> Any:
        connect.master = master  # type: ignore[attr-defined]  # rank 0 hosts it while it beats
        return client

    heartbeat = Heartbeat(
        connect,
        rank=rank,
        peers=peers,
        heartbeat_timeout=heartbeat_timeout,
        store_address=f"{host}:{port}",
    )
    heartbeat.start()
    return heartbeat
