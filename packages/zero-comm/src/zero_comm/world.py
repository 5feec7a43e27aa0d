"""``init``: from the launcher's environment to the world :class:`Communicator`."""

from __future__ import annotations

import logging
import os
import subprocess

import torch

from . import host_watch
from .comm_options import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S, CommOptions
from .communicator import Communicator
from .errors import BackendUnavailableError
from .launcher_env import LaunchEnv, detect_launch_env
from .node_detection import detect_topology
from .topology import Topology

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl", "mpi")
_watchdogs: list[subprocess.Popen[bytes]] = []  # kept referenced while this rank lives


def resolve_backend(backend: str, env: LaunchEnv) -> str:
    """The concrete backend ``"auto"`` stands for here: nccl on CUDA, mpi under an MPI
    launcher when mpi4py imports, else gloo. Other names are returned unchanged."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if backend != "auto":
        return backend
    if torch.cuda.is_available():
        return "nccl"
    if env.under_mpi_launcher:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "gloo"
        return "mpi"
    return "gloo"


def init(
    backend: str = "auto",
    *,
    deterministic: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    check_consistency: bool | str = "digest",
    ranks_per_node: int | None = None,
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> Communicator:
    """The world communicator of this process, as its launcher set it up.

    Args:
        backend: "gloo", "nccl", "mpi" or "auto" (see :func:`resolve_backend`).
        deterministic: every float SUM/AVG adds the ranks' contributions in rank order,
            ((g0 + g1) + g2) + ..., so results are bit-identical across backends, world
            sizes' algorithms, and the same sum computed in one process. This is the
            communication half of the determinism contract (packages/zero-core/README.md):

            - guaranteed, bit for bit: every ZeRO stage equals stage 0; N ranks equal one
              rank accumulating the same micro-batches in rank order; gloo equals MPI
              (and NCCL); a resumed or resharded run equals the uninterrupted one;
            - under equal fingerprints (zero_comm.determinism.current_fingerprint): the
              same torch build, BLAS and oneDNN, CPU model and vector ISA, intra-op
              threads per rank, deterministic-algorithms flag; and the same dtype, data,
              seed and micro-batch split;
            - not guaranteed: equality across CPU vendors, ISAs, BLAS builds or thread
              counts. Those change local arithmetic (a matmul, a layer-norm backward, a
              sum), not the reductions; runs then agree within the tolerance measured in
              the README, and a checkpoint resumed under another fingerprint warns.
        timeout: seconds the rendezvous and each collective may wait for the other ranks
            before raising :class:`~zero_comm.errors.CommTimeoutError`.
        check_consistency: compare each collective's (name, dtype, numel, op, root, label)
            across ranks before its data moves, so a mismatch raises on every rank instead of
            hanging or giving a wrong answer. True / "every": one small all-gather per
            collective. "digest": only calls not agreed on before in the same place, out of
            band (after a training loop's first step, nearly free). False / "off".
        ranks_per_node: the ranks on each node, node-major (rank r on node
            r // ranks_per_node); None: detect them (:func:`detect_topology`). The result
            is ``comm.topology``.
        heartbeat_timeout: seconds a peer may go without a heartbeat before a rank waiting
            on it in a collective raises :class:`~zero_comm.errors.PeerFailureError`
            naming it (stopped, swapped out, hung in C code); a peer that left the job
            (closed zero_comm, or its interpreter exited) is named as soon as its
            check-out is seen. A slow collective whose peers beat still waits up to
            ``timeout``. Every rank beats into the rendezvous store (gloo, nccl; under
            mpi, a store rank 0 opens for it: see zero_comm.heartbeat); nccl's waits do
            not block the host, so there only the digest check's waits use it.

    An existing world is adopted, not duplicated: where ``torch.distributed`` is already
    initialised by someone else (Lightning, Accelerate, a script that called
    ``init_process_group`` itself), and ``backend`` is "auto" or that group's backend,
    ``init`` returns :func:`zero_comm.from_process_group` over the default group with the
    options given here, reading no launcher variables (it says so at INFO on the logger
    ``zero_comm.world``). A ``backend`` that differs from the group's raises. Only
    ``backend="mpi"`` makes a world of its own beside it.
    """
    options = CommOptions(deterministic, check_consistency, timeout, heartbeat_timeout)
    if backend != "mpi" and _initialised_by_someone_else():
        return _adopt_default_group(backend, options, ranks_per_node)
    env = detect_launch_env()
    if ranks_per_node is not None:
        try:
            Topology.uniform(env.world_size, ranks_per_node)  # checked before any rendezvous
        except ValueError as exc:
            raise ValueError(f"[rank {env.rank}] zero_comm.init: {exc}") from None
    chosen = resolve_backend(backend, env)
    log.debug("zero_comm.init: %s, backend %s (asked %s)", env, chosen, backend)
    # An MPI launcher kills the survivors of a dead rank before they can name it: a
    # watchdog per host does (host_watch.py). Started before the backend (and before MPI
    # initialises, which forking after may upset), joined once the backend's set-up has
    # synchronised the ranks, so it is listening by then.
    watched = (
        env.under_mpi_launcher
        and env.world_size > 1
        and os.environ.get("ZERO_COMM_WATCHDOG", "1") != "0"
        and not host_watch.connected()  # a second init in this process: watched already
    )
    if watched and env.local_rank == 0:
        watchdog = host_watch.start(env.launcher, env.local_world_size)
        if watchdog is not None:
            _watchdogs.append(watchdog)
    comm = _create(chosen, env, options)
    if watched:
        host_watch.connect(env.launcher, env.rank)
    comm.set_topology(detect_topology(comm, ranks_per_node=ranks_per_node))
    log.debug("zero_comm.init: %s", comm.topology)
    return comm


def _initialised_by_someone_else() -> bool:
    """Whether torch.distributed's default group exists and zero_comm did not create it."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    from .world_session import WorldSession

    return not WorldSession.created_here()


def _adopt_default_group(
    backend: str, options: CommOptions, ranks_per_node: int | None
) -> Communicator:
    import torch.distributed as dist

    from .adopt import backend_of, from_process_group

    try:
        chosen = backend_of(dist.group.WORLD, dist.get_rank(), backend)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(
            f"{exc} (zero_comm.init adopts the default group torch.distributed was "
            "initialised with)"
        ) from None
    log.info(
        "zero_comm.init: torch.distributed is already initialised (%s, rank %d of %d): "
        "adopting its default group instead of creating a world",
        chosen, dist.get_rank(), dist.get_world_size(),
    )  # fmt: skip
    return from_process_group(
        None,
        backend=chosen,
        deterministic=options.deterministic,
        timeout=options.timeout,
        check_consistency=options.check_consistency,
        ranks_per_node=ranks_per_node,
        heartbeat_timeout=options.heartbeat_timeout,
    )


def _create(chosen: str, env: LaunchEnv, options: CommOptions) -> Communicator:
    if chosen == "mpi":
        from .mpi_backend import MPICommunicator, mpi_world_check

        if env.launcher != "none":
            mpi_world_check(env.rank)
        comm: Communicator = MPICommunicator.create_world(options)
        if comm.world_size != env.world_size:
            raise BackendUnavailableError(
                f"[rank {env.rank}] MPI sees {comm.world_size} ranks but the {env.launcher} "
                f"launcher says {env.world_size}; start the job with mpiexec/mpirun/srun"
            )
        return comm
    from .torch_backend import TorchCommunicator

    return TorchCommunicator.create(chosen, env, options)
