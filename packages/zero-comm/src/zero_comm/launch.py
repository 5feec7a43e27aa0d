"""``zero-launch -n N CMD ...``: start N local ranks of a command, and stop them together.

Each rank gets the variables :func:`zero_comm.init` reads (the same as torchrun's):

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT,
    ZERO_LAUNCHER=zero-launch, and OMP_NUM_THREADS = cores // N (at least 1) unless set.

A Python script that declares DeepSpeed's ``--local_rank`` (or torch's ``--local-rank``)
argument also gets ``--local_rank=<local rank>`` right after the script, as DeepSpeed's
launcher gives it: such scripts read ``args.local_rank`` and, left at its default of -1,
take their non-distributed path (every rank reading the whole data set).
``--local-rank-arg auto`` (the default) adds it only where the script's source declares
it, in the spelling it declares; ``always`` adds it to any command, ``never`` (or
DeepSpeed's ``--no_local_rank``) to none (zero_comm.local_rank_arg). A script that reads
``os.environ["LOCAL_RANK"]`` instead (torchrun's way) needs nothing: it is always set.

SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 are forwarded to every rank, and the ranks then end
as they choose (zero-train saves first). Otherwise, when a rank exits non-zero (or is
killed), the others are sent SIGTERM, then SIGKILL after ``--grace`` seconds, and
zero-launch exits non-zero naming that rank. It needs nothing but Python.

No orphans: on Linux each rank asks the kernel to SIGKILL it when zero-launch itself dies
(``prctl(PR_SET_PDEATHSIG)``, set by a small shim that then execs the command), so a
launcher killed with SIGKILL, which can forward nothing, leaves no rank running and
writing. Under torchrun, mpiexec and srun their own launchers do the same: torchrun's
agent and Hydra's proxies kill their ranks when they are stopped, and srun's step ends
with its tasks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from typing import NamedTuple

from .local_rank_arg import MODES, LocalRankMode, with_local_rank


class RankFailure(NamedTuple):
    """The first rank that failed, and how."""

    rank: int
    returncode: int


def free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(base: dict[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``world_size``."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ZERO_LAUNCHER="zero-launch",
    )
    if "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


# Run before each rank's command (Linux): die with the launcher, then become the command.
# PR_SET_PDEATHSIG is 1; it survives exec. A launcher gone before the call is seen in the
# parent pid. A command that cannot be executed is said in one line, exit code 127.
DIE_WITH_LAUNCHER = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    # One write: the ranks' lines must not interleave mid-line (print writes in parts).
    os.write(2, f"zero-launch: {sys.argv[2]} cannot be started: {exc.strerror}\\n".encode())
    os._exit(127)
"""
CANNOT_START = 127  # the shim's code for a command that could not be executed (a shell's)


def rank_command(command: Sequence[str]) -> list[str]:
    """``command`` as a rank runs it: under the die-with-the-launcher shim on Linux."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", DIE_WITH_LAUNCHER, str(os.getpid()), *command]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Relayed to every rank: Ctrl-C, a scheduler's TERM, and the user signals SLURM's
# --signal sends ahead of a time limit.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def launch(
    command: Sequence[str],
    world_size: int,
    *,
    grace: float = 5.0,
    reported_codes: Collection[int] = (),
    local_rank_arg: LocalRankMode = "auto",
) -> int:
    """Run ``command`` as ``world_size`` ranks; return 0 if all succeed, else non-zero.

    A signal in FORWARDED_SIGNALS is passed to every rank; if then every rank exits with
    the same code, that code is returned, without a message (the ranks said why). A rank
    exiting with one of ``reported_codes`` (codes after which the command itself has told
    the user why, as zero-train's failed save) stops the others without a message too.
    ``local_rank_arg``: whether each rank's command gets ``--local_rank=<n>`` (auto: where
    its Python source declares it; zero_comm.local_rank_arg)."""
    if world_size < 1:
        raise ValueError(f"-n must be at least 1, got {world_size}")
    if local_rank_arg not in MODES:
        raise ValueError(f"--local-rank-arg {local_rank_arg!r}: choose one of {', '.join(MODES)}")
    if not command:
        raise ValueError("no command given: zero-launch -n N CMD [ARGS ...]")
    if not grace >= 0:
        raise ValueError(f"--grace {grace} must be seconds >= 0")
    found = shutil.which(command[0])
    if found is None:  # else every rank's Popen raised, a traceback after the first started
        where = "is not an executable file" if os.path.exists(command[0]) else "is not found"
        raise ValueError(
            f"{command[0]} {where}"
            + ("" if os.sep in command[0] else " on PATH")
            + ": give a program (e.g. python my_script.py)"
        )
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    failure: RankFailure | None = None
    try:
        for rank in range(world_size):
            env = rank_environment(dict(os.environ), rank, world_size, port)
            ranks_command = with_local_rank(command, rank, local_rank_arg)
            procs.append(
                subprocess.Popen(rank_command(ranks_command), env=env, start_new_session=True)
            )
        while failure is None and any(p.poll() is None for p in procs):
            for rank, proc in enumerate(procs):
                code = proc.poll()
                # After a forwarded signal every rank has it and decides how to end (a
                # trainer saves, then exits): none is stopped for another's exit code.
                if code is not None and code != 0 and not forwarded:
                    failure = RankFailure(rank, code)
                    break
            else:
                time.sleep(0.02)
        codes = {p.poll() for p in procs}
        if forwarded and len(codes) == 1 and None not in codes and codes != {0}:
            # Every rank ended alike after the signal: the ranks said why; their code.
            code = int(codes.pop() or 0)
            return code if code > 0 else 128 - code
        if failure is None:
            # Every rank may have ended within one poll interval: the loop then stops
            # before naming a failure, and the first non-zero code is the failure.
            failure = next(
                (RankFailure(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0),
                None,
            )
        if failure is not None and failure.returncode in (*reported_codes, CANNOT_START):
            _stop(procs, grace)  # the command has told the user why: no line of ours
            return failure.returncode
        if failure is not None:
            running = [r for r, p in enumerate(procs) if p.poll() is None]
            _stop(procs, grace)
            stopped = f"; stopped ranks {running}" if running else ""
            print(
                f"zero-launch: rank {failure.rank} {describe_exit(failure.returncode)}{stopped}",
                file=sys.stderr,
                flush=True,
            )
            if failure.returncode > 0:
                return failure.returncode
            return 128 - failure.returncode
        return 128 + forwarded[0] if forwarded else 0
    finally:
        _stop(procs, grace)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="zero-launch",
        description="Start N local ranks of a command with the environment zero_comm.init reads.",
    )
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument(
        "--local-rank-arg",
        choices=MODES,
        default="auto",
        help="give each rank --local_rank=<local rank> after the script, as DeepSpeed's "
        "launcher does: auto (default) where the Python script's source declares "
        "'--local_rank' or '--local-rank' (in that spelling), always, or never. "
        "LOCAL_RANK is in the environment in every case",
    )
    parser.add_argument(
        "--no_local_rank",
        action="store_const",
        const="never",
        dest="local_rank_arg",
        help="DeepSpeed's spelling of --local-rank-arg never",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        code = launch(command, args.nproc, grace=args.grace, local_rank_arg=args.local_rank_arg)
    except ValueError as exc:
        parser.error(str(exc))
    sys.exit(code)


if __name__ == "__main__":
    main()
