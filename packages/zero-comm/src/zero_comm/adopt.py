"""Adopting a world someone else made: a torch.distributed process group, or an mpi4py
communicator, wrapped as a :class:`Communicator` without creating a second world.

Frameworks that own the process group (Lightning, Accelerate, a torchrun script that calls
``init_process_group`` itself, an MPI program with its own communicators) hand it over::

    torch.distributed.init_process_group("gloo")      # theirs
    comm = zero_comm.from_process_group()              # ours, over their default group
    sub = zero_comm.from_process_group(their_subgroup)
    comm = zero_comm.from_mpi_comm(MPI.COMM_WORLD.Split(color, key))

What a communicator that ``zero_comm.init`` makes has, and where an adopted one gets it:

    rank, world size     the group's (``dist.get_rank(group)``, ``Get_rank()``)
    device               nccl: the CUDA device the group is bound to, else the current one
                         (LOCAL_RANK's while the current one is still cuda:0); gloo, mpi: cpu
    peers (host, pid)    one all-gather at adoption (a dead rank of this host is named)
    topology             detect_topology; a group that is not the whole world in world order
                         is found by host name (the launcher's variables describe world ranks)
    digest check         the default group's store (every member of any group reaches it),
                         under a prefix of this group and adoption; mpi: a duplicate comm
    heartbeat            a connection of its own to that store where it is a TCPStore that the
                         group's rank 0 hosts; mpi: a store rank 0 opens, as init does

Where one cannot be had, the communicator says once, at WARNING, what is lost, and works
otherwise: no store for the digest check runs the check as "every"; no heartbeat leaves a
stopped or departed peer to the collective timeout.

An adopted group stays the application's: ``close()`` releases zero_comm's resources (its
heartbeat checks out) and never destroys the process group or frees the MPI communicator.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from .c10d_log import quiet_cpp_warnings
from .comm_options import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S, CommOptions
from .communicator import Communicator
from .errors import BackendUnavailableError
from .heartbeat import Heartbeat, first_beat
from .node_detection import detect_topology
from .peers import this_peer
from .rendezvous import _reachable
from .topology import Topology
from .torch_backend import TorchCommunicator

log = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("gloo", "nccl")
# Adoptions of each process group so far in this process, by group name: every member
# adopts a group alike, so the count names the adoption's store prefix on every member.
_adoptions: dict[str, int] = {}


def from_process_group(
    group: Any = None,
    *,
    backend: str = "auto",
    deterministic: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    check_consistency: bool | str = "digest",
    ranks_per_node: int | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Communicator:
    """Collective over ``group``: a communicator over an initialised torch.distributed
    process group that the caller (or its framework) made; no second world is created.

    Args:
        group: a ``torch.distributed`` process group this process is a member of; None is
            the default group (``torch.distributed.group.WORLD``). Its backend must be gloo
            or nccl (also as one of a device-keyed set such as ``"cpu:gloo,cuda:nccl"``).
        backend: which of the group's backends to drive: "auto" is its only one, or, of a
            device-keyed set, nccl where CUDA is available, else gloo; "gloo" or "nccl"
            must be one the group has (else BackendUnavailableError naming its own).
        deterministic, timeout, check_consistency, ranks_per_node, heartbeat_timeout: as
            for :func:`zero_comm.init`. ``timeout`` bounds zero_comm's waits; the group's
            own timeout, set by its creator, still bounds torch's.

    Returns a communicator whose ``rank`` and ``world_size`` are the group's; its
    topology, consistency check and dead-rank naming work as on a world ``init`` makes
    (see the module doc for where each comes from, and what is said where one cannot).
    ``close()`` leaves the process group to its owner.

    Raises:
        BackendUnavailableError: torch.distributed is not initialised, or the group's
            backend is not gloo or nccl.
        ValueError: this process is not a member of ``group``.
        TypeError: ``group`` is not a process group (an mpi4py communicator: use
            :func:`from_mpi_comm`).
    """
    options = CommOptions(deterministic, check_consistency, timeout, heartbeat_timeout)
    if _looks_like_mpi_comm(group):
        raise TypeError(
            "zero_comm.from_process_group got an mpi4py communicator; adopt it with "
            "zero_comm.from_mpi_comm(comm)"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise BackendUnavailableError(
            "zero_comm.from_process_group: torch.distributed is not initialised in this "
            "process; call torch.distributed.init_process_group(...) first, or let "
            "zero_comm.init() create the world"
        )
    group = dist.group.WORLD if group is None else group
    world_rank = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives a non-member
        raise ValueError(
            f"[rank {world_rank}] zero_comm.from_process_group: this process is not a member "
            "of the group (new_group returned GroupMember.NON_GROUP_MEMBER here); adopt a "
            "group only on its members"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"[rank {world_rank}] zero_comm.from_process_group needs a torch.distributed "
            f"process group (or None for the default one), got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"[rank {world_rank}] zero_comm.from_process_group: this process is not a member "
            f"of the group of world ranks {dist.get_process_group_ranks(group)}; adopt a "
            "group only on its members"
        )
    backend = backend_of(group, world_rank, backend)
    device = _device_for(backend, group)
    store = _default_store()
    if store is None and options.check_consistency == "digest":
        log.warning(  # on every rank: there is no channel yet to agree who says it
            "zero_comm: [rank %d] the adopted group has no store: the consistency check "
            "runs as 'every' (one small all-gather per collective) instead of 'digest'",
            world_rank,
        )
        options = CommOptions(deterministic, True, timeout, heartbeat_timeout)
    comm = TorchCommunicator(group, backend=backend, device=device, options=options)
    comm.owns_group = False
    comm.adopted_world = True
    name = _group_name(group)
    count = _adoptions[name] = _adoptions.get(name, 0) + 1
    prefix = f"zero_comm/adopted/{name}/{count}"
    comm._calls_store = store
    comm._calls_prefix = f"{prefix}/calls"
    comm.peers = [this_peer()] if comm.world_size == 1 else comm.all_gather_object(this_peer())
    if comm.world_size > 1:
        comm._heartbeat = _heartbeat_for(comm, group, store, prefix)
    comm.set_topology(_topology(comm, ranks_per_node, whole_world=_is_whole_world(group)))
    log.info(
        "zero_comm: adopted torch.distributed group %s (%s): rank %d of %d, device %s; %s",
        name, backend, comm.rank, comm.world_size, device, comm.topology,
    )  # fmt: skip
    return comm


def from_mpi_comm(
    mpi_comm: Any,
    *,
    deterministic: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    check_consistency: bool | str = "digest",
    ranks_per_node: int | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Communicator:
    """Collective over ``mpi_comm``: a communicator over an mpi4py intracommunicator the
    caller made (``MPI.COMM_WORLD``, a ``Split`` of it, ...). A separate function from
    :func:`from_process_group` because the two take different objects and raise
    different errors; each refuses the other's object, naming the right one.

    The communicator works on a duplicate (``Dup``) of ``mpi_comm``, so its traffic never
    matches the caller's own messages; ``close()`` frees the duplicate, not ``mpi_comm``.
    Options as for :func:`zero_comm.init`. Its heartbeat lives in a store that rank 0 of
    ``mpi_comm`` opens (as under ``init(backend="mpi")``); the per-host watchdog that
    ``init`` starts under an MPI launcher is not started (an adopted program may not be
    the launcher's only one).
    """
    from .mpi_backend import MPICommunicator, import_mpi

    options = CommOptions(deterministic, check_consistency, timeout, heartbeat_timeout)
    mpi = import_mpi()
    if not isinstance(mpi_comm, mpi.Intracomm) or mpi_comm == mpi.COMM_NULL:
        raise TypeError(
            "zero_comm.from_mpi_comm needs an mpi4py intracommunicator (MPI.COMM_WORLD or a "
            f"Split of it), got {type(mpi_comm).__name__}; a torch.distributed process group "
            "is adopted with zero_comm.from_process_group(group)"
        )
    comm = MPICommunicator.adopt(mpi_comm, options)
    whole = mpi.Comm.Compare(mpi_comm, mpi.COMM_WORLD) in (mpi.IDENT, mpi.CONGRUENT)
    comm.set_topology(_topology(comm, ranks_per_node, whole_world=whole))
    log.info(
        "zero_comm: adopted an MPI communicator: rank %d of %d; %s",
        comm.rank, comm.world_size, comm.topology,
    )  # fmt: skip
    return comm


def backend_of(group: Any, world_rank: int, wanted: str = "auto") -> str:
    """The backend zero_comm drives ``group`` with, "gloo" or "nccl": ``wanted`` where the
    group has it, or for "auto" its only one (of a device-keyed set such as
    "cpu:gloo,cuda:nccl": nccl where CUDA is available, else gloo). Raises
    BackendUnavailableError naming the fix for any other."""
    if wanted not in ("auto", *SUPPORTED_BACKENDS):
        raise ValueError(f"backend={wanted!r} is not one of 'auto', 'gloo', 'nccl'")
    name = str(dist.get_backend(group))
    # A group made without a backend name has one per device type ("cpu:gloo,cuda:nccl"),
    # and get_backend says "undefined" for it.
    config = str(dist.distributed_c10d._world.pg_backend_config.get(group, ""))
    per_device = dict(pair.split(":", 1) for pair in config.split(",") if ":" in pair)
    has = {name} | set(per_device.values())
    shown = name if name in SUPPORTED_BACKENDS else (config or name)
    if wanted != "auto":
        if wanted in has:
            return wanted
        raise BackendUnavailableError(
            f"[rank {world_rank}] the process group's backend is {shown!r}, not "
            f"{wanted!r}; ask for backend='auto' to adopt it as it is, or create the group "
            f"with the backend you want"
        )
    if name in SUPPORTED_BACKENDS:
        return name
    if torch.cuda.is_available() and per_device.get("cuda") == "nccl":
        return "nccl"
    if per_device.get("cpu") == "gloo":
        return "gloo"
    raise BackendUnavailableError(
        f"[rank {world_rank}] zero_comm cannot drive a process group with backend "
        f"{shown!r}: it supports gloo and nccl. Create the group with "
        "init_process_group('gloo') or ('nccl') (or new_group(backend=...)), or, for MPI, "
        "adopt the mpi4py communicator with zero_comm.from_mpi_comm"
    )


def _looks_like_mpi_comm(obj: Any) -> bool:
    return type(obj).__module__.startswith("mpi4py")


def _device_for(backend: str, group: Any) -> torch.device:
    """gloo: the CPU. nccl: the device the group is bound to; else the current CUDA device,
    unless that is still cuda:0 and LOCAL_RANK names another (a launcher's rank that has
    not chosen its device yet)."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "zero_comm.from_process_group: the group's backend is nccl but torch sees no GPU "
            "here; create the group with the gloo backend on CPU machines"
        )
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    current = torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if current == 0 and local_rank.isdigit():
        current = int(local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(current)
    return torch.device("cuda", current)


def _default_store() -> Any:
    """The default group's store (every member of any group reaches it), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, KeyError, AttributeError):
        return None


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    if name is None:
        name = dist.distributed_c10d._get_process_group_name(group)
    return str(name)


def _is_whole_world(group: Any) -> bool:
    """Whether ``group`` holds every world rank, in world order (its ranks are then the
    ones the launcher's variables describe)."""
    ranks = dist.get_process_group_ranks(group)
    return bool(ranks == list(range(dist.get_world_size())))


def _tcp_store_under(store: Any) -> Any:
    """The TCPStore under ``store``'s PrefixStores, or None (a FileStore, a HashStore)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, TCPStore) else None


def _heartbeat_for(comm: Communicator, group: Any, store: Any, prefix: str) -> Heartbeat | None:
    """Collective over ``comm``: a heartbeat for the adopted group, under ``prefix`` in the
    default group's TCPStore, or None on every member (said once, at WARNING)."""

    tcp = _tcp_store_under(store)
    why = ""
    if tcp is None:
        why = "the default group's store is not a TCPStore"
    elif dist.get_global_rank(group, 0) != 0:
        why = "the store's host, world rank 0, is not this group's rank 0"
    client = None
    if not why:
        try:
            _reachable(tcp.host, tcp.port)
            client = PrefixStore(
                prefix,
                TCPStore(
                    tcp.host,
                    tcp.port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=comm.heartbeat_timeout),
                    wait_for_workers=False,
                ),
            )
            first_beat(client, comm.rank)
        except (RuntimeError, OSError) as exc:
            why = f"this rank cannot reach the store at {tcp.host}:{tcp.port} ({exc})"
            client = None
    # Every member starts one, or none does; after this gather every counter exists.
    answers = comm.all_gather_object(why)
    if any(answers):
        if comm.rank == 0:  # said once for the group, with the first rank's reason
            who, first = next((r, a) for r, a in enumerate(answers) if a)
            log.warning(
                "zero_comm: no heartbeat on the adopted group (%s, said by its rank %d): a "
                "stopped or departed peer is found by the collective timeout (%g s) only; a "
                "dead one on the same host is still named",
                first, who, comm.timeout,
            )  # fmt: skip
        return None
    assert tcp is not None and comm.peers is not None
    quiet_cpp_warnings()  # a dead rank 0's store: our one line, not c10d's stacks
    heartbeat = Heartbeat(
        lambda: client,
        rank=comm.rank,
        peers=comm.peers,
        heartbeat_timeout=comm.heartbeat_timeout,
        store_address=f"{tcp.host}:{tcp.port}",
    )
    heartbeat.start()
    return heartbeat


def _topology(comm: Communicator, ranks_per_node: int | None, *, whole_world: bool) -> Topology:
    """detect_topology for an adopted communicator: the launcher's variables and
    ZERO_RANKS_PER_NODE describe world ranks, so a group that is not the whole world in
    world order is found by host name (or MPI's shared-memory split) instead."""
    return detect_topology(comm, ranks_per_node=ranks_per_node, environ=None if whole_world else {})
