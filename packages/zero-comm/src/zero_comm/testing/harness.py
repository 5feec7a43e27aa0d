"""Run one test body on N real ranks, under zero-launch, mpiexec or torchrun.

    def body(comm: Communicator) -> None:      # module level, in an importable file
        ...assertions...

    run_on_ranks(body, world_size=3, backend="gloo", launcher="spawn")

Each rank imports the body's file, calls ``zero_comm.init(backend)``, runs the body, and
then all ranks agree on the outcome (an all-gather of pass/fail), so a failure on one rank
fails every rank and none is left waiting in a later collective. Each rank writes a small
JSON result; the caller raises :class:`RanksFailed` unless *every* rank reported success.
A rank that never reports (failed to start, failed to initialise, crashed, was killed by
the timeout) is a failure, never a pass. A rank that fails before its communicator exists
leaves its peers waiting in the rendezvous (under mpiexec nothing stops them), so once one
reports such a failure the run is stopped ``INIT_FAILURE_GRACE`` seconds later instead of
at the peers' communicator timeout.

Every rank computes with the caller's intra-op thread count (``torch.get_num_threads()``
here, passed to each rank), and reports its fingerprint (zero_comm.determinism) after the
body: a rank whose fingerprint differs from the caller's fails the run, naming the
difference, because a bitwise comparison of its results with the caller's would not hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from zero_comm.determinism import current_fingerprint, fingerprint_differences

LAUNCHERS = ("spawn", "mpiexec", "torchrun")
INIT_FAILURE_GRACE = 3.0  # seconds the launcher gets to stop by itself after such a failure


class RanksFailed(AssertionError):
    """Some rank of a distributed test did not report success; the message says which."""


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (a venv with the ``mpich`` wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's (prterun/orterun), which needs --oversubscribe for
    more ranks than cores, and its allow-root variables as root; else MPICH-like."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def launch_command(launcher: str, world_size: int, rank_command: Sequence[str]) -> list[str]:
    """The command line that starts ``rank_command`` on ``world_size`` local ranks."""
    if launcher == "spawn":
        return [sys.executable, "-m", "zero_comm.launch", "-n", str(world_size), *rank_command]
    if launcher == "torchrun":
        rest = list(rank_command)
        if rest[:1] == [sys.executable]:
            rest = rest[1:]
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world_size}", "--no-python", sys.executable, *rest,
        ]  # fmt: skip
    if launcher == "mpiexec":
        mpiexec = find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("no mpiexec found: pip install mpich mpi4py (or the site's MPI)")
        extra = ["--oversubscribe"] if is_open_mpi(mpiexec) else []
        rest = list(rank_command)
        if rest[:1] == [sys.executable]:
            # -m mpi4py: an uncaught exception on one rank aborts the job, not a hang.
            rest = [sys.executable, "-m", "mpi4py", *rest[1:]]
        return [mpiexec, *extra, "-n", str(world_size), *rest]
    raise ValueError(f"launcher={launcher!r} is not one of {LAUNCHERS}")


def _body_location(body: Callable[..., Any]) -> tuple[str, str]:
    module = sys.modules.get(body.__module__)
    path = getattr(module, "__file__", None)
    if path is None or "<locals>" in body.__qualname__:
        raise ValueError(
            f"{body.__qualname__} must be a module-level function of an importable file so "
            "every rank can import it"
        )
    return os.path.abspath(path), body.__qualname__


def run_on_ranks(
    body: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    launcher: str = "spawn",
    deterministic: bool = True,
    timeout: float = 120.0,
    comm_timeout: float = 60.0,
    kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run ``body(comm, **kwargs)`` on ``world_size`` ranks; return each rank's report.

    Raises :class:`RanksFailed` if any rank failed, did not report, or the run exceeded
    ``timeout`` seconds (then every rank is killed). ``comm_timeout`` is the timeout given
    to ``zero_comm.init``, so a stuck collective fails well before the run's timeout.
    """
    path, qualname = _body_location(body)
    with tempfile.TemporaryDirectory(prefix="zero-ranks-") as result_dir:
        rank_command = [
            sys.executable, "-m", "zero_comm.testing.rank_main",
            "--file", path, "--body", qualname, "--backend", backend,
            "--results", result_dir, "--comm-timeout", str(comm_timeout),
            "--kwargs", json.dumps(kwargs or {}), "--threads", str(torch.get_num_threads()),
        ]  # fmt: skip
        if deterministic:
            rank_command.append("--deterministic")
        command = launch_command(launcher, world_size, rank_command)
        threads = str(torch.get_num_threads())
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        output, stopped = _wait_for_ranks(proc, Path(result_dir), timeout)
        reports = _read_reports(Path(result_dir), world_size)
    text = output.decode(errors="replace")
    problems = [stopped] if stopped else []
    mine = current_fingerprint()
    for rank, report in enumerate(reports):
        if report is None:
            problems.append(f"rank {rank} never reported (failed to start or initialise, or died)")
        elif not report["ok"]:
            problems.append(f"rank {rank} failed:\n{report['error']}")
        elif differences := fingerprint_differences(mine, report["fingerprint"]):
            named = "; ".join(f"{d.what} {d.before!r} here, {d.now!r} on the rank"
                              for d in differences)  # fmt: skip
            problems.append(
                f"rank {rank} computed under another fingerprint than this process, so its "
                f"bits are not comparable with this process's: {named} (a body must leave "
                "the thread count the harness set)"
            )
    if proc.returncode != 0 and not problems:
        problems.append(f"the launcher exited with code {proc.returncode}")
    if problems:
        raise RanksFailed(
            f"{qualname} on {world_size} ranks ({backend}, {launcher}):\n"
            + "\n".join(problems)
            + f"\n--- output (last 4000 characters) ---\n{text[-4000:]}"
        )
    return [r for r in reports if r is not None]


def _wait_for_ranks(
    proc: subprocess.Popen[bytes], results: Path, timeout: float
) -> tuple[bytes, str]:
    """The launcher's output once it exits, and why it was stopped ("" if it was not):
    at ``timeout``, or ``INIT_FAILURE_GRACE`` after a rank reported failing to initialise."""
    deadline = time.monotonic() + timeout
    init_failed_at: float | None = None
    stopped = ""
    while True:
        try:
            output, _ = proc.communicate(timeout=0.25)
            return output, stopped
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if init_failed_at is None and _an_initialisation_failed(results):
            init_failed_at = now
        if now > deadline:
            stopped = f"the run exceeded {timeout}s and every rank was killed"
        elif init_failed_at is not None and now - init_failed_at > INIT_FAILURE_GRACE:
            stopped = (
                "a rank failed before its communicator existed, and the launcher had not "
                f"stopped the others {INIT_FAILURE_GRACE:.0f}s later: every rank was killed"
            )
        if stopped:
            _kill_process_tree(proc.pid)
            try:
                output, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a process that kept the pipe: give up on it
                output = b""
            return output, stopped


def _an_initialisation_failed(results: Path) -> bool:
    for path in results.glob("rank*.json"):
        try:
            if json.loads(path.read_text()).get("stage") == "init":
                return True
        except (OSError, ValueError):
            continue
    return False


def _kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (an MPI launcher's ranks may
    sit in groups of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, queue = [], [pid]
    while queue:
        current = queue.pop()
        doomed.append(current)
        queue.extend(children.get(current, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)


def _read_reports(result_dir: Path, world_size: int) -> list[dict[str, Any] | None]:
    reports: list[dict[str, Any] | None] = []
    for rank in range(world_size):
        path = result_dir / f"rank{rank}.json"
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            reports.append(None)
    return reports
