"""Measuring the emulated cluster's link: one timed TCP transfer from one host to another.

The two ends are small Python programs run inside the hosts' namespaces, so the bytes take
the path a rank's would: over the shaped link between hosts, over loopback within one.
"""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

from tools.cluster.launch import ClusterRunError, output_tail
from tools.cluster.network import ClusterNetwork, Host


class Throughput(NamedTuple):
    """A one-way TCP transfer: bytes, seconds (connect to the receiver's ack), bits/s."""

    nbytes: int
    seconds: float
    bits_per_s: float


def measure_throughput(
    cluster: ClusterNetwork,
    sender: Host,
    receiver: Host,
    nbytes: int = 16 << 20,
    timeout_s: float = 60.0,
) -> Throughput:
    """One TCP transfer of ``nbytes`` from ``sender`` to ``receiver`` (the same host:
    over loopback, to its own link address). Seconds from connect to the receiver's
    one-byte ack after the last byte, so one round trip is included."""
    port = cluster.free_port()
    receive = _RECEIVER.format(address=receiver.address, port=port, nbytes=nbytes)
    send = _SENDER.format(address=receiver.address, port=port, nbytes=nbytes)
    rx = subprocess.Popen(
        cluster.exec_argv(receiver, [sys.executable, "-c", receive]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tx = subprocess.run(
            cluster.exec_argv(sender, [sys.executable, "-c", send]),
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
            f"{output_tail(tx.stderr)}; receiver exit {rx.returncode}: {output_tail(rx_err)}",
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
