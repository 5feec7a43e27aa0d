"""Launching ranks on the emulated cluster: torchrun on every host, or MPICH's mpiexec.

Each launcher runs inside a host's namespace (``ip netns exec``) with an environment cleared
of any parent launcher's variables and gloo bound to the link (:func:`launch_env`). A launch
has one time limit for all its hosts; when it passes, or one host fails while others still
run (they would wait for it until their own timeouts), every process left in the namespaces
is ended, the launchers' workers included, and :class:`ClusterRunError` holds each node's
output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from tools.cluster.network import (
    COMMAND_TIMEOUT_S,
    ClusterNetwork,
    ClusterUnavailable,
    Host,
    signals_deferred,
    stop_namespace_processes,
)

TAIL_CHARS = 3000  # of each node's output in an error message
# Variables a parent launcher may have set that would confuse the launchers started here.
LAUNCHER_VARIABLES = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|HYDRA_.*|SLURM_.*|"
    r"ZERO_LAUNCHER|GLOO_SOCKET_IFNAME)$"
)


class NodeResult(NamedTuple):
    """What one host's launcher did: its exit status (None: killed at the timeout)."""

    node: int
    returncode: int | None
    stdout: str
    stderr: str


class ClusterRunError(RuntimeError):
    """A launch failed or timed out; ``results`` holds every node's output."""

    def __init__(self, message: str, results: list[NodeResult]) -> None:
        super().__init__(message)
        self.results = results


def output_tail(text: str, chars: int = TAIL_CHARS) -> str:
    """The last ``chars`` of a node's output, for an error message."""
    return text if len(text) <= chars else "..." + text[-chars:]


def launch_env(host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launcher on ``host``: this process's, without any parent
    launcher's variables, with one intra-op thread, unbuffered output, this Python's
    folder first on PATH, and gloo bound to the link's interface (so that between hosts
    it uses the shaped link; within a host the kernel routes it over loopback)."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARIABLES.match(k)}
    bindir = str(Path(sys.executable).parent)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME=host.interface,
        PATH=os.pathsep.join([bindir, env.get("PATH", "")]),
    )
    env.update(extra or {})
    return env


def run_torchrun(
    cluster: ClusterNetwork,
    script_args: Sequence[str],
    ranks_per_node: int = 2,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> list[NodeResult]:
    """``torchrun --nnodes <nodes> --nproc-per-node <ranks_per_node> script_args`` on
    every host (static rendezvous at host 0's link address), all within ``timeout_s``.

    Global rank = node * ranks_per_node + local rank (torchrun's GROUP_RANK is the node).
    Returns each node's result; with ``check``, raises :class:`ClusterRunError` holding
    every node's output tail when a node fails or the timeout passes. On a timeout, or
    a node failing while others still run (they would wait for it until their own
    timeouts), every process left in the namespaces is killed."""
    _check_ranks_per_node(ranks_per_node)
    port = cluster.free_port()
    master = cluster.hosts[0].address
    argvs = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes),
         "--nproc-per-node", str(ranks_per_node), "--node-rank", str(h.index),
         "--master-addr", master, "--master-port", str(port), *script_args]
        for h in cluster.hosts
    ]  # fmt: skip
    return launch(cluster, "torchrun", argvs, timeout_s, env, check)


def run_mpiexec(
    cluster: ClusterNetwork,
    script_args: Sequence[str],
    ranks_per_node: int = 2,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> list[NodeResult]:
    """MPICH's hydra ``mpiexec`` running ``python -m mpi4py script_args`` with
    ``ranks_per_node`` ranks on every host, all within ``timeout_s``.

    mpiexec runs in host 0's namespace and names itself by host 0's link address
    (``-localhost``), so hydra starts host 0's proxy itself and every other host's
    through its rsh launcher, for which a generated wrapper runs the proxy's command in
    that host's namespace (``ip netns exec``). Ranks are numbered host by host; hydra's
    hosts list tells MPICH which ranks share a host (MPI_LOCALRANKID, and its
    shared-memory transport within a host only). UCX, MPICH's network layer here, would
    otherwise reach the other "host" over shared memory too (it is one machine), so it
    is held to TCP over the link: UCX_TLS=tcp,self and UCX_NET_DEVICES=<link>.

    Returns one result, mpiexec's (every rank's output); with ``check``, raises
    :class:`ClusterRunError` on failure or timeout, after killing what is left.
    Raises :class:`ClusterUnavailable` where mpiexec is not MPICH's hydra or mpi4py
    is missing."""
    _check_ranks_per_node(ranks_per_node)
    mpiexec = _hydra_mpiexec()
    host0 = cluster.hosts[0]
    with tempfile.TemporaryDirectory(prefix=f"zero-{cluster.tag}-rsh-") as folder:
        wrapper = Path(folder, "netns-rsh")
        cases = "\n".join(f"  {h.address}) ns={h.namespace} ;;" for h in cluster.hosts)
        wrapper.write_text(
            "#!/bin/sh\n"
            "# hydra's rsh launcher: netns-rsh HOST COMMAND..., run in HOST's namespace\n"
            'host="$1"; shift\n'
            f'case "$host" in\n{cases}\n'
            '  *) echo "netns-rsh: no emulated host $host" >&2; exit 255 ;;\nesac\n'
            'exec ip netns exec "$ns" sh -c "$*"\n'
        )
        wrapper.chmod(0o755)
        argv = [
            mpiexec, "-launcher", "rsh", "-launcher-exec", str(wrapper),
            "-localhost", host0.address,
            "-hosts", ",".join(f"{h.address}:{ranks_per_node}" for h in cluster.hosts),
            "-n", str(cluster.nodes * ranks_per_node),
            sys.executable, "-m", "mpi4py", *script_args,
        ]  # fmt: skip
        transport = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": host0.interface}
        return launch(cluster, "mpiexec", [argv], timeout_s, {**transport, **(env or {})}, check)


def launch(
    cluster: ClusterNetwork,
    what: str,
    argvs: list[list[str]],
    timeout_s: float,
    env: Mapping[str, str] | None,
    check: bool,
    grace_s: float = 10.0,
) -> list[NodeResult]:
    """Start ``argvs[i]`` in host i's namespace; wait for all, at most ``timeout_s``."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: give the run a positive time limit")
    with tempfile.TemporaryDirectory(prefix=f"zero-{cluster.tag}-") as folder:
        logs = [
            (Path(folder, f"node{i}.out"), Path(folder, f"node{i}.err")) for i in range(len(argvs))
        ]
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for host, argv, (out, err) in zip(cluster.hosts, argvs, logs, strict=False):
                with out.open("wb") as stdout, err.open("wb") as stderr:
                    processes.append(
                        subprocess.Popen(
                            cluster.exec_argv(host, argv),
                            stdin=subprocess.DEVNULL,
                            stdout=stdout,
                            stderr=stderr,
                            env=launch_env(host, env),
                            start_new_session=True,  # out of a terminal's Ctrl-C
                        )
                    )
            _wait_all(processes, timeout_s, grace_s)
        finally:
            # Anything still running (a timeout, a failed peer, KeyboardInterrupt):
            # kill what is left in the namespaces, the launchers' workers included
            # (torchrun starts its workers in sessions of their own).
            with signals_deferred():
                killed = [p.poll() is None for p in processes]
                if any(killed):
                    stop_namespace_processes(cluster.namespaces)
                for p in processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=COMMAND_TIMEOUT_S)
        results = [
            NodeResult(
                i,
                None if was_killed else p.returncode,
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )
            for i, (p, was_killed, (out, err)) in enumerate(
                zip(processes, killed, logs, strict=True)
            )
        ]
    failed = [r for r in results if r.returncode not in (0, None)]
    if check and (failed or any(killed)):
        if failed:
            why = "failed" + (
                f"; nodes {[r.node for r in results if r.returncode is None]} were killed "
                f"{grace_s:g} s after the first failure"
                if any(killed)
                else ""
            )
        else:
            why = f"timed out after {timeout_s:g} s; every process was killed"
        detail = "\n".join(
            f"--- node {r.node} ({cluster.hosts[r.node].namespace}): "
            f"{'killed' if r.returncode is None else f'exit {r.returncode}'}\n"
            f"stdout:\n{textwrap.indent(output_tail(r.stdout), '  ')}\n"
            f"stderr:\n{textwrap.indent(output_tail(r.stderr), '  ')}"
            for r in results
        )
        raise ClusterRunError(f"{what} on the emulated cluster {why}:\n{detail}", results)
    return results


def _check_ranks_per_node(ranks_per_node: int) -> None:
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r}: give a positive number of ranks")


def _hydra_mpiexec() -> str:
    """The ``mpiexec`` beside this Python (else on PATH), checked to be MPICH's hydra and to
    have mpi4py; raises :class:`ClusterUnavailable` saying what is missing."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise ClusterUnavailable("no mpiexec found: pip install mpich mpi4py (MPICH's hydra)")
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=COMMAND_TIMEOUT_S, check=False).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterUnavailable(f"{found} --version failed: {exc}") from exc
    if "HYDRA" not in version:
        raise ClusterUnavailable(
            f"{found} is not MPICH's hydra mpiexec (Open MPI's cannot start its daemons in the "
            "namespaces this way); pip install mpich"
        )
    if importlib.util.find_spec("mpi4py") is None:
        raise ClusterUnavailable("mpi4py is not installed: pip install mpi4py")
    return found


def _wait_all(
    processes: Sequence[subprocess.Popen[bytes]], timeout_s: float, grace_s: float
) -> bool:
    """Wait until every process exits (True) or the deadline passes (False). Once one exits
    non-zero, the others get ``grace_s`` more to notice and exit themselves."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in processes]
        if all(c is not None for c in codes):
            return True
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace_s)
            grace_s = float("inf")  # set the shortened deadline once
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
