"""tools/cluster/emulated.py: two namespaces as hosts, a rate-limited link, torchrun and mpiexec.

Skips, with the reason, where namespaces cannot be made (not root, no iproute2). The link
runs at 200 Mbit/s here so that a 16 MiB all-gather takes ~0.6 s on it: long enough that
the rate shows against the launch noise, short enough for the default run.

Rate bounds, and why they hold: tbf lets through at most ``rate x t + burst`` bytes in t
seconds, counting the whole packet, as the interface's byte counters do; the burst is 64 KiB
(``ClusterNetwork._shape`` in tools/cluster/network.py). So bits counted / seconds may exceed
the rate only by the burst and by counting a window a little wider than the timed call:
1.25 x leaves room for both. The lower bounds are loose (a quarter of the rate) because the
machine is shared: they only say that the link carries traffic at roughly its rate, not at
some crawl.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tools.cluster import emulated as ec
from tools.cluster import network

# Run by torchrun (--module) and mpi4py (-m) as a module, with tool_env's PYTHONPATH.
PROBE = ["-m", "tools.cluster.probe"]
RATE = "200mbit"
RATE_BITS = 200e6
PROBE_MIB = 16


@pytest.fixture
def cluster() -> Iterator[ec.EmulatedCluster]:
    """A 2-host cluster at RATE, or a skip saying why none can be built here."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = ec.EmulatedCluster(2, RATE, "0.5ms").__enter__()
    except ec.ClusterUnavailable as exc:
        pytest.skip(f"emulated cluster unavailable: {exc}")
    try:
        assert built.link is not None
        # A kernel without sch_netem gets no delay, and that is never silent.
        warned = [w for w in caught if "no added delay" in str(w.message)]
        assert built.link.delay_applied != bool(warned), (built.link, caught)
        yield built
    finally:
        built.teardown()
    assert not set(built.namespaces) & set(ec.cluster_namespaces()), "namespaces left behind"


# -- pure parts ---------------------------------------------------------------------------------


@given(st.integers(1, 10**6), st.sampled_from(sorted(network._RATE_UNITS)))
def test_parse_rate_reads_tc_bit_rates(value: int, unit: str) -> None:
    assert ec.parse_rate(f"{value}{unit}") == value * network._RATE_UNITS[unit]


@pytest.mark.parametrize("text", ["1gbps", "100", "-1gbit", "0mbit", "fast", "1 gbit/s"])
def test_parse_rate_rejects_what_tc_would_read_otherwise(text: str) -> None:
    with pytest.raises(ValueError, match="rate="):
        ec.parse_rate(text)


def test_parse_delay() -> None:
    assert ec.parse_delay("0.5ms") == pytest.approx(5e-4)
    assert ec.parse_delay("500us") == pytest.approx(5e-4)
    assert ec.parse_delay("0") == 0.0
    with pytest.raises(ValueError, match="delay="):
        ec.parse_delay("5")


def test_not_root_is_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    with pytest.raises(ec.ClusterUnavailable, match="not root"), ec.EmulatedCluster():
        pass


# -- the link -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_link_is_rate_limited_and_loopback_is_not(cluster: ec.EmulatedCluster) -> None:
    h0, h1 = cluster.hosts
    nbytes = 8 << 20
    before = cluster.link_bytes(h0)
    across = cluster.measure_throughput(h0, h1, nbytes)
    middle = cluster.link_bytes(h0)
    within = cluster.measure_throughput(h0, h0, nbytes)  # to its own link address
    after = cluster.link_bytes(h0)
    assert RATE_BITS / 4 < across.bits_per_s < 1.25 * RATE_BITS, across
    assert middle[0] - before[0] >= nbytes  # it went over the link
    # Within a host the kernel routes even the link's own address over loopback: the link
    # counters do not move, and the rate is not the link's.
    assert after[0] - middle[0] < 64 << 10
    assert within.bits_per_s > 2 * RATE_BITS, within
    link = cluster.link
    assert link is not None
    if link.delay_applied:  # netem: connect and ack are two round trips of 2 x delay each
        assert cluster.measure_throughput(h0, h1, 1).seconds >= 0.9 * 4 * link.delay_s


# -- launchers ----------------------------------------------------------------------------------


def _probe_reports(stdout: str) -> list[dict[str, Any]]:
    found = [json.loads(m) for m in re.findall(r"^CLUSTER_PROBE (.*)$", stdout, re.MULTILINE)]
    return sorted(found, key=lambda r: r["rank"])


def _check_probe(
    cluster: ec.EmulatedCluster, reports: list[dict[str, Any]], local_var: str
) -> None:
    """Every rank reported, on the host its rank puts it on, and computed right; the world
    all-gather crossed the link at no more than its rate; the intra-host one did not."""
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], reports
    for r in reports:
        node = r["rank"] // 2
        assert r["world_size"] == 4
        assert r["node"] == node
        assert r["namespace"] == cluster.hosts[node].namespace
        assert r["env"][local_var] == str(r["rank"] % 2)
        assert r["all_reduce_ok"] and r["world"]["ok"] and r["intra"]["ok"], r
    for node in (0, 1):
        here = [r for r in reports if r["node"] == node]
        world = here[0]["world"]
        seconds = max(r["world"]["seconds"] for r in reports)
        # Whatever the algorithm, this host must receive the other host's 2 of 4 blocks.
        assert world["link_rx_bytes"] >= world["bytes"] // 2
        for counted in (world["link_rx_bytes"], world["link_tx_bytes"]):
            assert counted * 8 / seconds < 1.25 * RATE_BITS, (counted, seconds)
        # Intra-host: only the barriers' few packets cross the link, not the 16 MiB.
        assert here[0]["intra"]["link_tx_bytes"] < 64 << 10, here[0]["intra"]


@pytest.mark.gloo
@pytest.mark.timeout(120)
def test_torchrun_two_nodes_of_two_ranks(
    cluster: ec.EmulatedCluster, tool_env: dict[str, str]
) -> None:
    results = cluster.run_torchrun([*PROBE, "--mib", str(PROBE_MIB)], 2, timeout_s=100,
                                   env={"PYTHONPATH": tool_env["PYTHONPATH"]})  # fmt: skip
    assert [r.returncode for r in results] == [0, 0]
    reports = _probe_reports("".join(r.stdout for r in results))
    _check_probe(cluster, reports, "LOCAL_RANK")
    for r in reports:
        assert r["env"]["GROUP_RANK"] == str(r["node"])
        assert r["backend"] == "TorchCommunicator"


@pytest.mark.mpi
@pytest.mark.slow  # nox -s cluster runs it; the default run keeps the cluster small
@pytest.mark.timeout(120)
def test_mpiexec_two_nodes_of_two_ranks(
    cluster: ec.EmulatedCluster, tool_env: dict[str, str]
) -> None:
    try:
        results = cluster.run_mpiexec([*PROBE, "--mib", str(PROBE_MIB)], 2, timeout_s=100,
                                      env={"PYTHONPATH": tool_env["PYTHONPATH"]})  # fmt: skip
    except ec.ClusterUnavailable as exc:
        pytest.skip(f"mpiexec cannot reach the emulated hosts: {exc}")
    reports = _probe_reports(results[0].stdout)
    _check_probe(cluster, reports, "MPI_LOCALRANKID")
    for r in reports:
        assert r["env"]["PMI_RANK"] == str(r["rank"])
        assert r["backend"] == "MPICommunicator"


# -- teardown -----------------------------------------------------------------------------------

SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"{os.getpid()}.pid").touch()
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.gloo
@pytest.mark.slow  # nox -s cluster runs it
@pytest.mark.timeout(60)
def test_a_run_that_times_out_is_killed_and_torn_down(
    cluster: ec.EmulatedCluster, tmp_path: Path
) -> None:
    """torchrun starts its workers in sessions of their own: they must die too. The workers
    usually start within the 12 s (each pid file is then checked); the launchers always."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with pytest.raises(ec.ClusterRunError, match="timed out after 12 s") as caught:
        cluster.run_torchrun([str(script), str(tmp_path)], 2, timeout_s=12)
    assert [r.returncode for r in caught.value.results] == [None, None]
    assert [ec.namespace_pids(ns) for ns in cluster.namespaces] == [[], []]
    workers = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert not [pid for pid in workers if _running(pid)]
    # The cluster still works after a killed run, and leaving it removes the namespaces
    # (the fixture checks that).
    assert cluster.link_bytes(cluster.hosts[0])[0] > 0
