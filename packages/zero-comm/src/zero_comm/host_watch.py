"""A watchdog per host that names the rank which died first, where the launcher kills the rest.

Under ``mpiexec``/``mpirun`` a rank that dies (SIGKILL, a crash, an abort) makes the launcher
SIGKILL every other rank within a fraction of a second: no survivor lives long enough to
say which rank it lost, and MPICH's "BAD TERMINATION ... PID p" may name a rank it killed
itself. So the first rank on each host starts this small process in a session of its own
(out of the launcher's reach), every rank on the host connects to it, and::

    rank --hello R pid--> watchdog        at zero_comm.init
    rank --bye clean----> watchdog        at interpreter exit (or "bye error ..." after an
                                          uncaught exception)
    connection closes without "bye clean" = the rank ended abnormally

The first rank to end abnormally is the one that failed (the launcher's kills come after it:
it has to notice the death first); the watchdog at once writes one line naming it to the
launcher's standard error, which it opened at start-up so that the line still arrives
after the launcher has gone. It exits when every rank on the host has ended. On a job that
ends cleanly it says nothing.

On several hosts every host's watchdog reports the first abnormal end on its host, with
the wall-clock time, so the earliest line names the failure.
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO

try:
    from .peers import is_running
except ImportError:  # run as a script (see start); peers.py imports only the standard library
    from peers import is_running  # type: ignore[no-redef,import-not-found]

HELLO_TIMEOUT_S = 120.0  # ranks connect right after the communicator's creation
FILE_WAIT_S = 30.0  # how long a report into a file waits for the launcher to exit
LAUNCHER_NAMES = ("mpiexec", "mpirun", "prterun", "orterun", "srun")


def socket_name(launcher: str) -> str:
    """An abstract Unix socket name shared by this job's ranks on this host (all of them are
    children of one launcher daemon: hydra's proxy, prted, slurmstepd)."""
    return f"zero-comm-watch-{launcher}-{os.getuid()}-{os.getppid()}"


def launcher_process() -> int:
    """The process whose standard error the launcher writes its own errors to: the nearest
    ancestor named like a launcher (mpiexec on the host that started the job), else this
    process's parent (the launcher's daemon, which forwards what it is given while it runs)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if name.startswith(LAUNCHER_NAMES):
            return pid
        pid = parent
    return os.getppid()


def start(launcher: str, local_world_size: int) -> subprocess.Popen[bytes] | None:
    """Start this host's watchdog (the host's first rank calls this before the backend's
    set-up) and wait until it listens. None where it cannot start: the job runs unwatched."""
    launcher_pid = launcher_process()
    try:
        sink = open(f"/proc/{launcher_pid}/fd/2", "ab", buffering=0)  # noqa: SIM115
    except OSError:
        sink = None
    try:
        process = subprocess.Popen(
            # run as a script: importing the package would import torch (seconds)
            [
                sys.executable,
                str(Path(__file__).resolve()),
                socket_name(launcher),
                str(local_world_size),
                str(launcher_pid),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=sink if sink is not None else None,
            start_new_session=True,  # the launcher kills its children's group, not this one
        )
    except OSError:
        return None
    finally:
        if sink is not None:
            sink.close()
    assert process.stdout is not None
    ready = process.stdout.readline()
    process.stdout.close()
    return process if ready.strip() == b"ready" else None


class _Connection:
    """This rank's line to its host's watchdog; says goodbye at interpreter exit."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ending = "clean"
        previous_hook = sys.excepthook

        def note_uncaught(
            kind: type[BaseException], value: BaseException, tb: TracebackType | None
        ) -> None:
            self.ending = f"error {kind.__name__}"
            previous_hook(kind, value, tb)

        sys.excepthook = note_uncaught
        atexit.register(self.goodbye)

    def goodbye(self) -> None:
        try:
            self.sock.sendall(f"bye {self.ending}\n".encode())
            self.sock.close()
        except OSError:
            pass


_connected: list[_Connection] = []  # this process's line, once made (init may run again)


def connected() -> bool:
    """Whether this process has registered with its host's watchdog already."""
    return bool(_connected)


def connect(launcher: str, rank: int) -> _Connection | None:
    """Register this rank with its host's watchdog (None where there is none)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + socket_name(launcher))
        sock.sendall(f"hello {rank} {os.getpid()}\n".encode())
    except OSError:
        sock.close()
        return None
    _connected.append(_Connection(sock))
    return _connected[0]


def describe_end(rank: int, pid: int, ending: str, running: list[int]) -> str:
    """The line the watchdog writes about the first rank that ended abnormally."""
    when = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    how = (
        "raised an uncaught exception (" + ending.split(" ", 1)[1] + "; its traceback is above)"
        if ending.startswith("error")
        else "ended without closing zero_comm (killed, crashed or aborted)"
    )
    others = f"; ranks {running} were still running" if running else ""
    return (
        f"zero-comm: rank {rank} (pid {pid}, host {socket.gethostname()}) {how} at {when}, "
        f"the first rank of this host to fail{others}.\n"
    )


def watch(name: str, expected: int, launcher_pid: int, report: IO[str]) -> None:
    """The watchdog's loop: accept ``expected`` ranks, then report the first abnormal end.

    Into a terminal or a pipe the line goes at once. Into a regular file it waits for the
    launcher to exit (at most ``FILE_WAIT_S``): the launcher writes through a file offset of
    its own and would overwrite a line appended before its last words."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)  # abstract: nothing to clean up on disk
    server.listen(expected)
    print("ready", flush=True)
    sys.stdout.close()
    into_file = stat.S_ISREG(os.fstat(report.fileno()).st_mode)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    rank_of: dict[socket.socket, tuple[int, int]] = {}
    said: dict[socket.socket, bytes] = {}
    connected = 0
    line: str | None = None  # the report, until written
    reported = False
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    while True:
        if line is not None and (not into_file or not is_running(launcher_pid)):
            report.write(line)
            report.flush()
            line = None
        everyone_ended = connected == expected and not rank_of
        if everyone_ended and (line is None or time.monotonic() > deadline):
            break
        if connected < expected and time.monotonic() > deadline:
            break
        for key, _ in selector.select(timeout=0.05 if line is not None else 1.0):
            if key.fileobj is server:
                client, _ = server.accept()
                selector.register(client, selectors.EVENT_READ)
                said[client] = b""
                continue
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = sock.recv(4096)
            said[sock] += data
            lines = said[sock].split(b"\n")
            if sock not in rank_of and len(lines) > 1 and lines[0].startswith(b"hello "):
                _, rank, pid = lines[0].split()
                rank_of[sock] = (int(rank), int(pid))
                connected += 1
            if data:
                continue
            selector.unregister(sock)
            sock.close()
            byes = [said_line for said_line in lines if said_line.startswith(b"bye ")]
            ending = byes[-1][4:].decode() if byes else "no goodbye"
            who = rank_of.pop(sock, None)
            if who is None or ending == "clean" or reported:
                continue
            running = sorted(r for r, _ in rank_of.values())
            line = describe_end(who[0], who[1], ending, running)
            reported = True
            deadline = time.monotonic() + FILE_WAIT_S


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.stderr)
