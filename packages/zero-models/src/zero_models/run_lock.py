"""One run per results folder: zero-train holds ``OUT/.zero-train.lock`` while it runs.

    OUT/.zero-train.lock    {"host": "node7", "pid": 4242, "started": "2026-12-07T10:58:01"}

The lock is ``fcntl.flock`` on that file, so the kernel lets go of it when the holder
ends in any way (SIGKILL included): a lock is never left stale. The file's contents say
who holds it; a run that takes the lock and finds contents there learns that the last
holder ended without cleaning up, and says so once.

Who holds it: the process that owns the run, i.e. zero-train run by hand (which holds it
while its ranks run; they are told so through ZERO_TRAIN_HOLDS_OUT), or rank 0 under
another launcher (torchrun, mpiexec, srun). Two runs started together into one folder
once both died with a JSONDecodeError, and with other seeds one silently replaced the
other's results.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import TextIO

from zero_comm.launcher_env import detect_launch_env

LOCK_NAME = ".zero-train.lock"
HOLDER_VARIABLE = "ZERO_TRAIN_HOLDS_OUT"  # set for the ranks of a zero-train that holds it


class ResultsFolderBusy(RuntimeError):
    """Another live run holds the results folder."""


def owns_the_run(out: Path) -> bool:
    """Whether this process is the one that takes the lock of ``out``: not a rank whose
    zero-train already holds it, and under another launcher only rank 0."""
    if os.environ.get(HOLDER_VARIABLE) == str(out.resolve()):
        return False
    launch = detect_launch_env()
    return launch.launcher == "none" or launch.rank == 0


def holder_of(out: Path) -> str:
    """Who holds ``out``'s lock now, in words ("" if no live run does). Takes and drops
    the lock to find out, so it never blocks."""
    path = out / LOCK_NAME
    if not path.exists():
        return ""
    with path.open("a+") as probe:
        holder = _lock_or_holder(probe)
        if not holder:
            fcntl.flock(probe, fcntl.LOCK_UN)
    return holder


def busy_message(out: Path, holder: str) -> str:
    """The refusal of a run into ``out`` while ``holder`` (holder_of's words) runs."""
    return (
        f"--out {out} is in use by {holder}: wait for it to end, stop it, or name another "
        "--out (--overwrite and --resume do not take a live run's folder)"
    )


def _lock_or_holder(file: TextIO) -> str:
    """Take ``file``'s lock without waiting: "" if taken, else who holds it, in words."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        return describe(file.read())
    return ""


def describe(record: str) -> str:
    try:
        who = json.loads(record)
        return f"the run of pid {who['pid']} on {who['host']}, started {who['started']}"
    except (ValueError, KeyError, TypeError):
        return "another run (its lock file names no holder)"


class RunLock:
    """The held lock of one results folder; :meth:`release` (or the process's end) lets
    go. ``took_over``: the previous holder's words when it ended without releasing."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.file: TextIO | None = self.path.open("a+")
        holder = _lock_or_holder(self.file)
        if holder:
            self.file.close()
            self.file = None
            raise ResultsFolderBusy(busy_message(out, holder))
        self.file.seek(0)
        earlier = self.file.read().strip()
        self.took_over = describe(earlier) if earlier else ""
        self.file.seek(0)
        self.file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        self.file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                    "started": started}))  # fmt: skip
        self.file.flush()

    def release(self) -> None:
        """Empty the file (an ended run leaves no holder) and let go."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        self.file = None
