"""The host watchdog's protocol, with plain sockets standing in for ranks (no launcher).

Each rank says ``hello R pid`` and, when it ends normally, ``bye clean``; a connection
that closes otherwise is a rank that ended abnormally, and the watchdog names the first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_comm import host_watch

SCRIPT = Path(host_watch.__file__).resolve()


def start_watchdog(name: str, ranks: int, into: Path | None = None) -> subprocess.Popen[str]:
    sink = into.open("w") if into is not None else subprocess.PIPE
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), name, str(ranks), str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=sink,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def rank(name: str, number: int, pid: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    sock.sendall(f"hello {number} {pid}\n".encode())
    return sock


def end(sock: socket.socket, said: str | None) -> None:
    if said is not None:
        sock.sendall(f"bye {said}\n".encode())
    sock.close()


def unique_name() -> str:
    return f"zero-comm-watch-test-{os.getpid()}-{time.monotonic_ns()}"


@pytest.mark.parametrize(
    ("endings", "named"),
    [
        # (how ranks 0, 1, 2 end, in this order), the rank the watchdog names
        ([("clean", 0), ("clean", 1), ("clean", 2)], None),
        ([(None, 1), (None, 0), (None, 2)], 1),  # killed; the launcher kills the rest
        ([("clean", 2), (None, 0), (None, 1)], 0),  # a clean end before is no failure
        ([("error ValueError", 2), (None, 0), (None, 1)], 2),
    ],
)
def test_the_first_rank_to_end_abnormally_is_named(
    endings: list[tuple[str | None, int]], named: int | None
) -> None:
    name = unique_name()
    watchdog = start_watchdog(name, 3)
    socks = {r: rank(name, r, 1000 + r) for r in range(3)}
    time.sleep(0.2)  # all hellos read before the first end
    for said, r in endings:
        end(socks[r], said)
        time.sleep(0.05)
    _, report = watchdog.communicate(timeout=30)
    assert watchdog.returncode == 0
    if named is None:
        assert report == ""
        return
    lines = report.splitlines()
    assert len(lines) == 1, report
    assert lines[0].startswith(f"zero-comm: rank {named} (pid {1000 + named}, host "), report
    after = [r for _, r in endings].index(named) + 1
    still_running = sorted(r for _, r in endings[after:])
    assert f"ranks {still_running} were still running" in report
    if dict((r, said) for said, r in endings)[named] == "error ValueError":
        assert "raised an uncaught exception (ValueError" in report


def test_into_a_file_the_report_waits_for_the_launcher_to_exit(tmp_path: Path) -> None:
    """A launcher writing a file through its own offset would overwrite a line appended
    while it runs; the watchdog appends after it has gone (here: the launcher is a
    short-lived process standing in for mpiexec)."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    name = unique_name()
    log = tmp_path / "job.log"
    sink = log.open("w")
    watchdog = subprocess.Popen(
        [sys.executable, str(SCRIPT), name, "2", str(launcher.pid)],
        stdout=subprocess.PIPE,
        stderr=sink,
        text=True,
    )
    assert watchdog.stdout is not None and watchdog.stdout.readline().strip() == "ready"
    socks = [rank(name, r, 2000 + r) for r in range(2)]
    time.sleep(0.2)
    end(socks[1], None)
    end(socks[0], None)
    time.sleep(0.5)
    assert log.read_text() == ""  # the launcher still runs
    launcher.wait()
    watchdog.wait(timeout=30)
    assert log.read_text().startswith("zero-comm: rank 1 (pid 2001, host ")


def test_without_a_watchdog_a_rank_runs_unwatched() -> None:
    assert host_watch.connect("nobody-listens-" + unique_name(), 0) is None
