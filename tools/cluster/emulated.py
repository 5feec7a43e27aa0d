#!/usr/bin/env python
"""An emulated cluster on one machine: network namespaces as hosts, a rate-limited link.

    python -m tools.cluster.emulated run --nodes 2 --ranks-per-node 2 --rate 1gbit \\
        --delay 0.5ms -- -m tools.cluster.probe          # torchrun --nnodes 2 on each host
    python -m tools.cluster.emulated run --launcher mpiexec -- -m tools.cluster.probe
    python -m tools.cluster.emulated check --rate 1gbit  # measured link and loopback rates

    with EmulatedCluster(nodes=2, rate="200mbit") as cluster:
        results = cluster.run_torchrun(["-m", "tools.cluster.probe"], ranks_per_node=2)

:class:`EmulatedCluster` is the cluster as its users see it; this module also holds the
command line. The work is done in three modules beside it:

- ``tools.cluster.network``: the namespaces, the veth link shaped by tc, and their teardown
  (:class:`ClusterNetwork`, the context manager; its docstring draws the layout).
- ``tools.cluster.launch``: ranks launched inside them by torchrun or MPICH's mpiexec, under one
  time limit, with whatever is left killed.
- ``tools.cluster.throughput``: the link measured by one timed TCP transfer.

The CLI turns SIGTERM into KeyboardInterrupt, so that the ``with`` block tears the cluster
down then too.

What is emulated and what is not:

- Between hosts, traffic leaves by ``zlink`` and is shaped. Within a host, traffic between
  the host's own addresses (also ``zlink``'s, which gloo binds to under
  ``GLOO_SOCKET_IFNAME=zlink``) is routed over loopback by the kernel's local table and is
  not shaped: ``zlink``'s byte counters do not move (the probe and the tests check this).
- The hosts share the machine's hostname, process ids, /dev/shm and file system; only the
  network is separated. MPI's shared-memory transport between two "hosts" would work, so
  MPI must learn the node of each rank from the launcher (hydra's hosts list does this).
- ``delay`` needs the kernel's ``sch_netem``; without it the link is rate-limited only, and
  ``cluster.link.describe()`` says why (``require_delay=True`` raises instead).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip``/``tc`` (iproute2). Where they are
missing, :class:`ClusterUnavailable` says why; tests turn it into a skip with that reason.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from tools.cluster import launch, throughput

# The names users of this module import, re-exported from where they are defined.
from tools.cluster.launch import ClusterRunError as ClusterRunError
from tools.cluster.launch import NodeResult as NodeResult
from tools.cluster.network import DEFAULT_DELAY as DEFAULT_DELAY
from tools.cluster.network import DEFAULT_RATE as DEFAULT_RATE
from tools.cluster.network import ClusterNetwork
from tools.cluster.network import ClusterUnavailable as ClusterUnavailable
from tools.cluster.network import Host as Host
from tools.cluster.network import LinkShaping as LinkShaping
from tools.cluster.network import cluster_namespaces as cluster_namespaces
from tools.cluster.network import namespace_pids as namespace_pids
from tools.cluster.network import parse_delay as parse_delay
from tools.cluster.network import parse_rate as parse_rate
from tools.cluster.network import remove_stale_namespaces as remove_stale_namespaces
from tools.cluster.throughput import Throughput as Throughput


class EmulatedCluster(ClusterNetwork):
    """``nodes`` hosts as network namespaces joined by a shaped link, with launchers and a
    link measurement; a context manager (:class:`ClusterNetwork` builds and removes it,
    and its docstring lists the arguments)."""

    def launch_env(self, host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A launcher's environment on ``host`` (:func:`launch.launch_env`)."""
        return launch.launch_env(host, extra)

    def run_torchrun(
        self,
        script_args: Sequence[str],
        ranks_per_node: int = 2,
        timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> list[NodeResult]:
        """``torchrun --nnodes <nodes>`` on every host, all within ``timeout_s``; one result
        per node (:func:`launch.run_torchrun` says how failures are handled)."""
        return launch.run_torchrun(self, script_args, ranks_per_node, timeout_s, env, check)

    def run_mpiexec(
        self,
        script_args: Sequence[str],
        ranks_per_node: int = 2,
        timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> list[NodeResult]:
        """MPICH's hydra ``mpiexec`` across every host, all within ``timeout_s``; one result,
        mpiexec's (:func:`launch.run_mpiexec` says how hosts are reached)."""
        return launch.run_mpiexec(self, script_args, ranks_per_node, timeout_s, env, check)

    def measure_throughput(
        self, sender: Host, receiver: Host, nbytes: int = 16 << 20, timeout_s: float = 60.0
    ) -> Throughput:
        """One timed TCP transfer from ``sender`` to ``receiver``
        (:func:`throughput.measure_throughput`)."""
        return throughput.measure_throughput(self, sender, receiver, nbytes, timeout_s)


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
            cmd.add_argument("script", nargs=argparse.REMAINDER, help="-- script|-m module [args]")
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
                parser.error("run: give the script after --, e.g. -- -m tools.cluster.probe")
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
