#!/usr/bin/env python
"""One rank's view of the emulated cluster (tools/cluster/emulated.py), as one JSON line.

    python -m tools.cluster.emulated run --rate 200mbit -- -m tools.cluster.probe
    cluster.run_torchrun(["-m", "tools.cluster.probe", "--mib", "16"])   # from Python

Every rank prints ``CLUSTER_PROBE {json}`` with:

- ``rank``, ``world_size``, ``node`` (rank // local world size: torchrun and hydra number
  ranks host by host), ``namespace`` (``ip netns identify``: the host it really ran on),
  and the launcher variables it saw (``env``: LOCAL_RANK, GROUP_RANK, ...);
- ``all_reduce_ok``: an all-reduce of integers held exactly in float64 equals its closed form;
- ``world`` and ``intra``: a ~``--mib`` MiB float32 all-gather (the output's size) over all
  ranks and then over this node's ranks (``comm.split`` by node), each with
  ``ok`` (every rank's block holds that rank's value), ``seconds`` (this rank's wall time of
  the call, after a barrier) and ``link_tx_bytes`` / ``link_rx_bytes`` (what this host's
  link interface sent and received from just before the call to just after a barrier
  following it: every rank of the host, the barrier's few bytes included).

The link counters come from /sys/class/net/<GLOO_SOCKET_IFNAME>/statistics; where the
variable is unset (not on the emulated cluster) they are null.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import zero_comm

SEEN_VARIABLES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "RANK",
                  "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # fmt: skip


def link_counters() -> tuple[int, int] | None:
    """(tx_bytes, rx_bytes) of this host's link interface, or None off the cluster."""
    name = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("ZERO_CLUSTER_IFNAME")
    if not name:
        return None
    stats = Path("/sys/class/net", name, "statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def namespace() -> str | None:
    """The network namespace this process runs in, by its ``ip netns`` name."""
    try:
        done = subprocess.run(["ip", "netns", "identify", str(os.getpid())],
                              capture_output=True, text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def timed_all_gather(comm: zero_comm.Communicator, nbytes: int) -> dict[str, Any]:
    """A float32 all-gather whose output is ~``nbytes``; each rank contributes rank + 1."""
    chunk = max(1, nbytes // 4 // comm.world_size)
    inp = torch.full((chunk,), float(comm.rank + 1))
    out = torch.empty(chunk * comm.world_size)
    comm.barrier()
    before = link_counters()
    start = time.perf_counter()
    comm.all_gather(out, inp)
    seconds = time.perf_counter() - start
    comm.barrier()
    after = link_counters()
    expected = torch.arange(1, comm.world_size + 1, dtype=torch.float32).repeat_interleave(chunk)
    return {
        "bytes": out.numel() * out.element_size(),
        "ok": bool(torch.equal(out, expected)),
        "seconds": seconds,
        "link_tx_bytes": None if before is None or after is None else after[0] - before[0],
        "link_rx_bytes": None if before is None or after is None else after[1] - before[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--backend", default="auto", help="zero_comm.init backend")
    parser.add_argument("--mib", type=float, default=16.0, help="all-gather output size")
    args = parser.parse_args()
    nbytes = int(args.mib * (1 << 20))

    launch = zero_comm.detect_launch_env()
    comm = zero_comm.init(args.backend)
    rank, world = comm.rank, comm.world_size
    node = rank // launch.local_world_size

    # Integers up to 2**20, summed over a few ranks: exact in float64 in any order.
    values = torch.arange(1024, dtype=torch.float64) + 1024.0 * rank
    comm.all_reduce(values)
    expected = world * torch.arange(1024, dtype=torch.float64) + 1024.0 * world * (world - 1) / 2
    all_reduce_ok = bool(torch.equal(values, expected))

    timed_all_gather(comm, 4096)  # warm-up: connections and buffers, not timed
    whole = timed_all_gather(comm, nbytes)
    local = comm.split(color=node, key=rank)
    timed_all_gather(local, 4096)
    intra = timed_all_gather(local, nbytes)
    report = {
        "rank": rank,
        "world_size": world,
        "backend": type(comm).__name__,
        "local_world_size": launch.local_world_size,
        "node": node,
        "namespace": namespace(),
        "env": {name: os.environ.get(name) for name in SEEN_VARIABLES},
        "all_reduce_ok": all_reduce_ok,
        "world": whole,
        "intra": intra,
    }
    # One write with its newline: ranks on a node share the launcher's pipe, and print()
    # on an unbuffered stdout writes the line and its newline apart, so two ranks' lines
    # could run together (a CI run read two reports as one line). A pipe write of at most
    # PIPE_BUF bytes is not interleaved.
    sys.stdout.flush()
    os.write(1, ("CLUSTER_PROBE " + json.dumps(report) + "\n").encode())
    comm.barrier()


if __name__ == "__main__":
    main()
