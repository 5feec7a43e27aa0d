#!/usr/bin/env python
"""An emulated cluster on one machine: network namespaces as hosts, a rate-limited link.

    python tools/emulated_cluster.py run --nodes 2 --ranks-per-node 2 --rate 1gbit \\
        --delay 0.5ms -- tools/cluster_probe.py          # torchrun --nnodes 2 on each host
    python tools/emulated_cluster.py run --launcher mpiexec -- tools/cluster_probe.py
    python tools/emulated_cluster.py check --rate 1gbit  # measured link and loopback rates

    with EmulatedCluster(nodes=2, rate="200mbit") as cluster:
        results = cluster.run_torchrun(["tools/cluster_probe.py"], ranks_per_node=2)

Layout for ``nodes=2`` (``<tag>`` = ``<pid>-<n>``, unique per cluster on this machine)::

    namespace zero-<tag>-h0                    namespace zero-<tag>-h1
    lo 127.0.0.1 (fast, unshaped)              lo 127.0.0.1 (fast, unshaped)
    zlink 10.213.<x>.1/24 ===== veth ======== zlink 10.213.<x>.2/24
          egress: tbf rate R (+ netem delay D)      egress: tbf rate R (+ netem delay D)

With ``nodes > 2`` every host's ``zlink`` is a veth to a bridge in a third namespace
``zero-<tag>-sw``; both ends of each veth are shaped, so a packet between two hosts passes
two shaped egresses (the rate is R, the one-way delay 2 D).

Every address exists only inside these namespaces: nothing is routed to or from the
machine's own network, and teardown (``ip netns delete``, after ending every process left
inside) removes the veths with them. Teardown runs on leaving the ``with`` block for any
reason (an error, a timeout, KeyboardInterrupt; the CLI turns SIGTERM into one).

What is emulated and what is not:

- Between hosts, traffic leaves by ``zlink`` and is shaped. Within a host, traffic between
  the host's own addresses (also ``zlink``'s, which gloo binds to under
  ``GLOO_SOCKET_IFNAME=zlink``) is routed over loopback by the kernel's local table and is
  not shaped: ``zlink``'s byte counters do not move (the probe and the tests check this).
- The hosts share the machine's hostname, process ids, /dev/shm and file system; only the
  network is separated. MPI's shared-memory transport between two "hosts" would work, so
  MPI must learn the node of each rank from the launcher (hydra's hosts list does this).
- ``delay`` needs the kernel's ``sch_netem`` (CONFIG_NET_SCH_NETEM). Where it is missing,
  the link is rate-limited only and the cluster says so: ``cluster.link.delay_applied`` is
  False, ``cluster.link.describe()`` names the reason, a warning is issued, and with
  ``require_delay=True`` the cluster raises :class:`ClusterUnavailable` instead.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip``/``tc`` (iproute2). Where they are
missing, :class:`ClusterUnavailable` says why; tests turn it into a skip with that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import NamedTuple

from zero_comm.peers import is_running

DEFAULT_RATE = "1gbit"
DEFAULT_DELAY = "0.5ms"
INTERFACE = "zlink"  # the link's name inside every host namespace
SUBNET_BASE = "10.213"  # 10.213.<x>.0/24, x from the pid: only inside our namespaces
COMMAND_TIMEOUT_S = 20.0  # one ip/tc command
TAIL_CHARS = 3000  # of each node's output in an error message
# Variables a parent launcher may have set that would confuse the launchers started here.
LAUNCHER_VARIABLES = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|HYDRA_.*|SLURM_.*|"
    r"ZERO_LAUNCHER|GLOO_SOCKET_IFNAME)$"
)

_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built or a launcher cannot reach it here; the message
    says why (tests skip with it)."""


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


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace and its address on the link."""

    index: int
    namespace: str
    address: str
    interface: str = INTERFACE


@dataclass(frozen=True)
class LinkShaping:
    """How the inter-host link is shaped, as applied (not only as asked)."""

    rate: str
    rate_bits_per_s: float
    delay: str
    delay_s: float
    delay_applied: bool
    note: str = ""

    def describe(self) -> str:
        if self.delay_applied:
            return f"tbf rate {self.rate}, netem delay {self.delay}"
        return f"tbf rate {self.rate}, no delay" + (f" ({self.note})" if self.note else "")


class Throughput(NamedTuple):
    """A one-way TCP transfer: bytes, seconds (connect to the receiver's ack), bits/s."""

    nbytes: int
    seconds: float
    bits_per_s: float


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate written in bits: ``"1gbit" -> 1e9``, ``"200mbit"``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)\s*", text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"rate={text!r} is not a positive rate in bits per second; write it as tc does "
            "with one of bit, kbit, mbit, gbit, e.g. '1gbit' or '200mbit'"
        )
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def parse_delay(text: str) -> float:
    """Seconds of a tc delay: ``"0.5ms" -> 5e-4``, ``"0"`` or ``"0ms"`` -> 0."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", text.lower())
    if match is None or (match.group(2) is None and float(match.group(1)) != 0):
        raise ValueError(
            f"delay={text!r} is not a delay; write it with a unit, e.g. '0.5ms', '500us', or '0'"
        )
    return float(match.group(1)) * _DELAY_UNITS[match.group(2) or "s"]


def _tail(text: str, chars: int = TAIL_CHARS) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


class EmulatedCluster:
    """``nodes`` hosts as network namespaces joined by a shaped link; a context manager.

    Args:
        nodes: number of hosts (2: a veth pair; more: veths to a bridge namespace).
        rate: the link's rate per direction, tc syntax in bits ("1gbit", "200mbit").
        delay: one-way delay added per shaped egress ("0.5ms"; "0" for none).
        require_delay: raise :class:`ClusterUnavailable` where the kernel cannot add the
            delay (no sch_netem) instead of warning and running rate-limited only.

    Entering builds everything or, on any failure, removes what it built and raises
    :class:`ClusterUnavailable` with the reason; leaving kills every process still in the
    namespaces and deletes them.
    """

    def __init__(
        self,
        nodes: int = 2,
        rate: str = DEFAULT_RATE,
        delay: str = DEFAULT_DELAY,
        *,
        require_delay: bool = False,
    ) -> None:
        if nodes < 2:
            raise ValueError(f"nodes={nodes}: a cluster needs at least 2 hosts")
        if nodes > 250:
            raise ValueError(f"nodes={nodes}: at most 250 hosts fit the /24 subnet used")
        self.nodes = nodes
        self.rate = rate
        self.delay = delay
        self._rate_bits = parse_rate(rate)
        self._delay_s = parse_delay(delay)
        self.require_delay = require_delay
        self.tag = f"{os.getpid()}-{next(_counter)}"
        subnet = f"{SUBNET_BASE}.{os.getpid() % 250 + 1}"
        self.hosts = [Host(i, f"zero-{self.tag}-h{i}", f"{subnet}.{i + 1}") for i in range(nodes)]
        self.switch = f"zero-{self.tag}-sw" if nodes > 2 else None
        self.link: LinkShaping | None = None
        self._created: list[str] = []
        self._next_port = 29500

    # -- building and removing --------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        try:
            self._check_can_build()
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster (hosts, then the bridge's if any)."""
        return [h.namespace for h in self.hosts] + ([self.switch] if self.switch else [])

    def _check_can_build(self) -> None:
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise ClusterUnavailable(
                f"{' and '.join(missing)} not found: the emulated cluster needs iproute2"
            )
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise ClusterUnavailable(
                "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN "
                "(run as root, e.g. in a container started with --privileged)"
            )
        remove_stale_namespaces()

    def _build(self) -> None:
        for namespace in self.namespaces:
            self._ip("netns", "add", namespace)
            self._created.append(namespace)
            self._ip("-n", namespace, "link", "set", "lo", "up")
        if self.switch is None:
            a, b = self.hosts
            # Created directly inside the namespaces: the names never exist outside them.
            self._ip("link", "add", INTERFACE, "netns", a.namespace, "type", "veth",
                     "peer", "name", INTERFACE, "netns", b.namespace)  # fmt: skip
            shaped = [(a.namespace, INTERFACE), (b.namespace, INTERFACE)]
        else:
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            shaped = []
            for host in self.hosts:
                port = f"p{host.index}"
                self._ip("link", "add", INTERFACE, "netns", host.namespace, "type", "veth",
                         "peer", "name", port, "netns", self.switch)  # fmt: skip
                self._ip("-n", self.switch, "link", "set", port, "master", "br0")
                self._ip("-n", self.switch, "link", "set", port, "up")
                shaped += [(host.namespace, INTERFACE), (self.switch, port)]
        for host in self.hosts:
            self._ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
            self._ip("-n", host.namespace, "link", "set", INTERFACE, "up")
        notes = {self._shape(namespace, device) for namespace, device in shaped}
        note = "; ".join(sorted(n for n in notes if n))
        self.link = LinkShaping(
            self.rate,
            self._rate_bits,
            self.delay,
            self._delay_s,
            self._delay_s > 0 and not note,
            note,
        )
        if note:
            if self.require_delay:
                raise ClusterUnavailable(f"cannot add delay {self.delay} to the link: {note}")
            warnings.warn(
                f"emulated cluster: the link is rate-limited to {self.rate} but has no added "
                f"delay: {note}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _shape(self, namespace: str, device: str) -> str:
        """Rate-limit (and delay) ``device``'s egress; "" or why the delay is missing.

        tbf's bucket holds ~1 ms of the rate (at least 64 KiB: a GSO packet's worth, so
        tbf need not split them) and its queue 100 ms, so TCP never sees drops at the
        tbf (it backs off on the queue's delay instead). With a delay, netem is the root
        and holds each packet for ``delay`` before tbf paces it (the order tc-netem(8)
        documents)."""
        burst = max(int(self._rate_bits / 8 * 1e-3), 64 * 1024)
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if self._delay_s > 0:
            netem = self._run([*tc, "root", "handle", "1:", "netem", "delay", self.delay,
                               "limit", "100000"], check=False)  # fmt: skip
            if netem.returncode == 0:
                self._run([*tc, "parent", "1:1", "handle", "10:", *tbf])
                return ""
            reason = netem.stderr.strip() or f"tc exited {netem.returncode}"
            note = f"tc netem failed ({reason}); the kernel likely lacks sch_netem"
        else:
            note = ""
        self._run([*tc, "root", "handle", "1:", *tbf])
        return note

    def teardown(self) -> None:
        """Kill every process left in the namespaces, then delete them (and so the veths).
        Safe to call more than once; a second Ctrl-C or SIGTERM waits until it is done."""
        with signals_deferred():
            stop_namespace_processes(self._created)
            for namespace in reversed(self._created):
                subprocess.run(["ip", "netns", "delete", namespace], capture_output=True,
                               timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
            self._created = []

    def _ip(self, *args: str) -> None:
        self._run(["ip", *args])

    def _run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterUnavailable(f"{' '.join(argv)} failed: {exc}") from exc
        if check and done.returncode != 0:
            raise ClusterUnavailable(
                f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done

    # -- using it -----------------------------------------------------------------------------

    def exec_argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """(sent, received) bytes of ``host``'s link interface so far, headers included."""
        stats = f"/sys/class/net/{host.interface}/statistics"
        done = self._run(self.exec_argv(host, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]))
        sent, received = done.stdout.split()
        return int(sent), int(received)

    def free_port(self) -> int:
        """A TCP port for a rendezvous: every namespace is new, so none is taken there;
        each launch gets its own so that one launch's TIME_WAIT sockets never matter."""
        self._next_port += 1
        return self._next_port

    def launch_env(self, host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
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
        self,
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
        port = self.free_port()
        master = self.hosts[0].address
        argvs = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
             "--nproc-per-node", str(ranks_per_node), "--node-rank", str(h.index),
             "--master-addr", master, "--master-port", str(port), *script_args]
            for h in self.hosts
        ]  # fmt: skip
        return self._launch("torchrun", argvs, timeout_s, env, check)

    def run_mpiexec(
        self,
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
        host0 = self.hosts[0]
        with tempfile.TemporaryDirectory(prefix=f"zero-{self.tag}-rsh-") as folder:
            wrapper = Path(folder, "netns-rsh")
            cases = "\n".join(f"  {h.address}) ns={h.namespace} ;;" for h in self.hosts)
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
                "-hosts", ",".join(f"{h.address}:{ranks_per_node}" for h in self.hosts),
                "-n", str(self.nodes * ranks_per_node),
                sys.executable, "-m", "mpi4py", *script_args,
            ]  # fmt: skip
            transport = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": host0.interface}
            return self._launch("mpiexec", [argv], timeout_s, {**transport, **(env or {})}, check)

    def _launch(
        self,
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
        with tempfile.TemporaryDirectory(prefix=f"zero-{self.tag}-") as folder:
            logs = [
                (Path(folder, f"node{i}.out"), Path(folder, f"node{i}.err"))
                for i in range(len(argvs))
            ]
            processes: list[subprocess.Popen[bytes]] = []
            try:
                for host, argv, (out, err) in zip(self.hosts, argvs, logs, strict=False):
                    with out.open("wb") as stdout, err.open("wb") as stderr:
                        processes.append(
                            subprocess.Popen(
                                self.exec_argv(host, argv),
                                stdin=subprocess.DEVNULL,
                                stdout=stdout,
                                stderr=stderr,
                                env=self.launch_env(host, env),
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
                        stop_namespace_processes(self.namespaces)
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
                f"--- node {r.node} ({self.hosts[r.node].namespace}): "
                f"{'killed' if r.returncode is None else f'exit {r.returncode}'}\n"
                f"stdout:\n{textwrap.indent(_tail(r.stdout), '  ')}\n"
                f"stderr:\n{textwrap.indent(_tail(r.stderr), '  ')}"
                for r in results
            )
            raise ClusterRunError(f"{what} on the emulated cluster {why}:\n{detail}", results)
        return results

    def measure_throughput(
        self, sender: Host, receiver: Host, nbytes: int = 16 << 20, timeout_s: float = 60.0
    ) -> Throughput:
        """One TCP transfer of ``nbytes`` from ``sender`` to ``receiver`` (the same host:
        over loopback, to its own link address). Seconds from connect to the receiver's
        one-byte ack after the last byte, so one round trip is included."""
        port = self.free_port()
        receive = _RECEIVER.format(address=receiver.address, port=port, nbytes=nbytes)
        send = _SENDER.format(address=receiver.address, port=port, nbytes=nbytes)
        rx = subprocess.Popen(
            self.exec_argv(receiver, [sys.executable, "-c", receive]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            tx = subprocess.run(
                self.exec_argv(sender, [sys.executable, "-c", send]),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            rx_err = rx.communicate(timeout=timeout_s)[1]
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        if tx.returncode != 0 or rx.returncode != 0:
            raise ClusterRunError(
                f"throughput measurement failed: sender exit {tx.returncode}: "
                f"{_tail(tx.stderr)}; receiver exit {rx.returncode}: {_tail(rx_err)}",
                [],
            )
        seconds = float(tx.stdout.strip())
        return Throughput(nbytes, seconds, nbytes * 8 / seconds)


# The two ends of measure_throughput, run with -c inside the namespaces.
_RECEIVER = """
import socket
s = socket.create_server(("{address}", {port}))
s.settimeout(30)
c, _ = s.accept()
left = {nbytes}
buf = bytearray(1 << 20)
while left:
    n = c.recv_into(buf, min(left, len(buf)))
    if not n:
        raise SystemExit("sender closed early")
    left -= n
c.sendall(b"k")
"""
_SENDER = """
import socket, time
deadline = time.monotonic() + 10
while True:
    try:
        start = time.perf_counter()
        c = socket.create_connection(("{address}", {port}), timeout=30)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
chunk = bytes(1 << 20)
left = {nbytes}
while left:
    n = min(left, len(chunk))
    c.sendall(chunk[:n])
    left -= n
assert c.recv(1) == b"k"
print(time.perf_counter() - start)
"""


def _check_ranks_per_node(ranks_per_node: int) -> None:
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r}: give a positive number of ranks")


def _hydra_mpiexec() -> str:
    """The ``mpiexec`` beside this Python (else on PATH), checked to be MPICH's hydra and to
    have mpi4py; raises :class:`ClusterUnavailable` saying what is missing."""
    import importlib.util

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


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGALRM (pytest-timeout's) in this thread until the block
    ends, so that cleanup is not cut short by a second signal; they are delivered after."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def namespace_pids(namespace: str) -> list[int]:
    """Processes inside ``namespace`` (``ip netns pids``); [] where it is gone."""
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def stop_namespace_processes(
    namespaces: Sequence[str], grace_s: float = 3.0, rounds: int = 20
) -> None:
    """End every process inside ``namespaces`` (all started by their cluster): SIGTERM first,
    so that launchers end and reap their workers (torchrun starts them in sessions of their
    own), then SIGKILL after ``grace_s`` until none is left (a process may fork while being
    killed) or ``rounds`` tries have passed."""

    def alive() -> list[int]:
        return [p for ns in namespaces for p in namespace_pids(ns) if p != os.getpid()]

    def send(pids: list[int], signum: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    send(alive(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(rounds):
        pids = alive()
        if not pids:
            return
        send(pids, signal.SIGKILL)
        time.sleep(0.05)


def cluster_namespaces() -> list[str]:
    """Names of every namespace this tool made on this machine and that still exists."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(r"zero-\d+-\d+-(h\d+|sw)", n)]


def remove_stale_namespaces() -> list[str]:
    """Delete the namespace names of clusters whose creating process is gone (a run killed
    with SIGKILL could not tear down). Processes still inside are left alone; the
    namespace itself ends with the last of them. Returns the names deleted."""
    stale = [n for n in cluster_namespaces() if not is_running(int(n.split("-")[1]))]
    for name in stale:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True,
                       timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    return stale


# -- command line ---------------------------------------------------------------------------


def _terminate_on_sigterm() -> None:
    """SIGTERM becomes KeyboardInterrupt, so the ``with`` block tears the cluster down."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "launch a script on every host (arguments after --)"),
        ("check", "measure the link's and loopback's TCP throughput"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--nodes", type=int, default=2)
        cmd.add_argument("--rate", default=DEFAULT_RATE, help="per direction, tc syntax")
        cmd.add_argument("--delay", default=DEFAULT_DELAY, help="one-way, per shaped egress")
        cmd.add_argument("--require-delay", action="store_true",
                         help="fail where the kernel cannot delay (no sch_netem)")  # fmt: skip
        if name == "run":
            cmd.add_argument("--ranks-per-node", type=int, default=2)
            cmd.add_argument("--launcher", choices=("torchrun", "mpiexec"), default="torchrun")
            cmd.add_argument("--timeout", type=float, default=600.0, help="seconds, whole run")
            cmd.add_argument("script", nargs=argparse.REMAINDER, help="-- script [args]")
        else:
            cmd.add_argument("--mib", type=int, default=64, help="MiB per transfer")
    args = parser.parse_args(argv)
    _terminate_on_sigterm()
    try:
        with EmulatedCluster(args.nodes, args.rate, args.delay,
                             require_delay=args.require_delay) as cluster:  # fmt: skip
            assert cluster.link is not None
            print(f"emulated cluster: {args.nodes} hosts "
                  f"({', '.join(h.namespace + ' ' + h.address for h in cluster.hosts)}); "
                  f"link: {cluster.link.describe()}", file=sys.stderr, flush=True)  # fmt: skip
            if args.command == "check":
                return _check(cluster, args.mib << 20)
            script = args.script[1:] if args.script[:1] == ["--"] else args.script
            if not script:
                parser.error("run: give the script after --, e.g. -- tools/cluster_probe.py")
            run = cluster.run_torchrun if args.launcher == "torchrun" else cluster.run_mpiexec
            try:
                results = run(script, args.ranks_per_node, args.timeout, check=False)
            except ClusterRunError as exc:  # a measurement error, never with check=False
                print(exc, file=sys.stderr)
                return 1
            for r in results:
                sys.stdout.write(r.stdout)
                sys.stderr.write(r.stderr)
                print(f"node {r.node}: exit {r.returncode}", file=sys.stderr)
            return 0 if all(r.returncode == 0 for r in results) else 1
    except ClusterUnavailable as exc:
        print(f"emulated cluster unavailable: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}): the cluster is torn down", file=sys.stderr)
        return 130


def _check(cluster: EmulatedCluster, nbytes: int) -> int:
    a, b = cluster.hosts[0], cluster.hosts[1]
    rows = {
        "link h0->h1": cluster.measure_throughput(a, b, nbytes),
        "link h1->h0": cluster.measure_throughput(b, a, nbytes),
        "within h0 (to its own link address)": cluster.measure_throughput(a, a, nbytes),
    }
    assert cluster.link is not None
    for name, t in rows.items():
        print(f"{name:40s} {t.bits_per_s / 1e6:10.1f} Mbit/s  ({t.nbytes >> 20} MiB in "
              f"{t.seconds:.3f} s; configured link rate {cluster.link.rate})")  # fmt: skip
    print(json.dumps({k: t._asdict() for k, t in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
