"""CPU quotas per rank with cgroups, for bench.py's --mode quota (root only).

    quota = CpuQuota(launcher_pid, (1.0, 0.5))   # rank 0: one CPU, rank 1: half of one
    ...                                           # the run
    quota.remove()

A background thread finds the rank processes among ``launcher_pid``'s descendants (by the
RANK variable zero-launch gives each), and moves each into a cgroup of its own whose CPU
bandwidth is capped: cgroup v2's ``cpu.max`` ("QUOTA PERIOD") where a cgroup2 mount has the
cpu controller, else cgroup v1's ``cpu.cfs_quota_us``/``cpu.cfs_period_us``. Threads are
untouched, so the bits are those of the run without quotas.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

PERIOD_US = 10_000  # short: a throttled rank waits at most this long in a collective
FIND_SECONDS = 120.0


def _mounts() -> list[tuple[str, str, str]]:
    """(type, mount point, options) of each cgroup mount."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, kind, options, *_ = line.split()
        if kind in ("cgroup", "cgroup2"):
            found.append((kind, point, options))
    return found


def cpu_cgroup_root() -> tuple[str, Path] | None:
    """('v2', mount) with the cpu controller, else ('v1', the cpu hierarchy), else None."""
    for kind, point, _ in _mounts():
        controllers = Path(point) / "cgroup.controllers"
        if kind == "cgroup2" and controllers.exists() and "cpu" in controllers.read_text().split():
            return "v2", Path(point)
    for kind, point, options in _mounts():
        if kind == "cgroup" and "cpu" in options.split(","):
            return "v1", Path(point)
    return None


def quota_problem() -> str:
    """Why quotas cannot be set here ("" if they can)."""
    if os.geteuid() != 0:
        return "needs root (cgroups are written as root)"
    root = cpu_cgroup_root()
    if root is None:
        return "no cgroup mount has the cpu controller"
    probe = root[1] / f"zero-hetero-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot make a cgroup under {root[1]} ({exc.strerror})"
    return ""


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


class CpuQuota:
    """Caps rank i of the job under ``launcher_pid`` at ``cpus[i]`` CPUs (module docstring)."""

    def __init__(self, launcher_pid: int, cpus: tuple[float, ...]) -> None:
        root = cpu_cgroup_root()
        if root is None:
            raise RuntimeError("no cgroup mount has the cpu controller")
        self.version, base = root
        self.groups = [base / f"zero-hetero-{os.getpid()}-rank{i}" for i in range(len(cpus))]
        for group, share in zip(self.groups, cpus, strict=True):
            group.mkdir(exist_ok=True)
            quota = int(share * PERIOD_US)
            if self.version == "v2":
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
        self.moved: dict[int, int] = {}  # rank -> pid
        self._thread = threading.Thread(target=self._move, args=(launcher_pid,), daemon=True)
        self._thread.start()

    def _move(self, launcher_pid: int) -> None:
        deadline = time.monotonic() + FIND_SECONDS
        while len(self.moved) < len(self.groups) and time.monotonic() < deadline:
            pending = [launcher_pid]
            while pending:
                pid = pending.pop()
                rank = _rank_of(pid)
                if rank is not None and rank < len(self.groups) and rank not in self.moved:
                    try:
                        (self.groups[rank] / "cgroup.procs").write_text(str(pid))
                        self.moved[rank] = pid
                    except OSError:
                        pass
                pending += _children(pid)
            time.sleep(0.05)

    def remove(self) -> None:
        """Remove the cgroups (their processes have ended, or go back to the root)."""
        self._thread.join(timeout=1)
        for group in self.groups:
            with contextlib.suppress(OSError):  # a process still in it: left for the admin
                group.rmdir()
