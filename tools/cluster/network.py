"""The emulated cluster's network: network namespaces as hosts, a shaped link, teardown.

:class:`ClusterNetwork` builds it on entering a ``with`` block and removes it on leaving.
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
reason (an error, a timeout, KeyboardInterrupt).

``delay`` needs the kernel's ``sch_netem`` (CONFIG_NET_SCH_NETEM). Where it is missing, the
link is rate-limited only and the cluster says so: ``link.delay_applied`` is False,
``link.describe()`` names the reason, a warning is issued, and with ``require_delay=True``
the cluster raises :class:`ClusterUnavailable` instead.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip``/``tc`` (iproute2). Where they are
missing, :class:`ClusterUnavailable` says why.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from zero_comm.peers import is_running

DEFAULT_RATE = "1gbit"
DEFAULT_DELAY = "0.5ms"
INTERFACE = "zlink"  # the link's name inside every host namespace
SUBNET_BASE = "10.213"  # 10.213.<x>.0/24, x from the pid: only inside our namespaces
COMMAND_TIMEOUT_S = 20.0  # one ip/tc command

_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built or a launcher cannot reach it here; the message
    says why (tests skip with it)."""


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


_Network = TypeVar("_Network", bound="ClusterNetwork")


class ClusterNetwork:
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

    def __enter__(self: _Network) -> _Network:
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

    # -- reaching into it ---------------------------------------------------------------------

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
