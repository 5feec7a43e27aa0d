"""``zero-launch``: run as a real command, with real rank processes (tier 3, kept small).

Each test starts ``python -m zero_comm.launch -n N python -c RANK_CODE``. The rank code
uses only the standard library and talks back through files in ``tmp_path``: what it saw,
its pid, that it is ready, that it got a signal. Every wait has a timeout, and any rank pid
a test learned is killed at teardown if it is still alive, so a broken launcher fails the
test instead of hanging it or leaking processes.

``python -m zero_comm.launch`` imports the package first; its names load on first use, so
the launcher never imports torch (:func:`test_the_launcher_imports_no_torch`). The time
bounds below include the start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from zero_comm.launch import describe_exit, launch, main, rank_environment

pytestmark = pytest.mark.timeout(60)

LAUNCH_TIMEOUT = 30.0  # seconds; far above any test here, only there to stop a hang.
LONG_SLEEP = 120  # seconds a rank sleeps when it should be stopped long before.


LAUNCH = [sys.executable, "-m", "zero_comm.launch"]


class Finished(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def launch_command(n: int, code: str, *options: str) -> list[str]:
    return [
        *LAUNCH,
        "-n",
        str(n),
        *options,
        sys.executable,
        "-c",
        textwrap.dedent(code),
    ]


def _env(tmp_path: Path, drop_omp: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env["TEST_DIR"] = str(tmp_path)
    if drop_omp:
        env.pop("OMP_NUM_THREADS", None)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours: cannot be a rank we started
        return False
    return True


def _rank_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid.*")) if p.read_text()]


@pytest.fixture
def rank_dir(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``; afterwards, every rank that wrote its pid there and still runs is killed."""
    yield tmp_path
    for pid in _rank_pids(tmp_path):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def run_launch(cmd: list[str], env: dict[str, str], out_dir: Path) -> Finished:
    """Run zero-launch to completion (or kill it after LAUNCH_TIMEOUT and fail)."""
    start = time.monotonic()
    with open(out_dir / "launch.out", "w+") as out, open(out_dir / "launch.err", "w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"zero-launch did not exit within {LAUNCH_TIMEOUT}s")
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return Finished(code, out.read(), err.read(), seconds)


def wait_for_files(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            pytest.fail(f"files {missing} did not appear within {timeout}s")
        time.sleep(0.02)


# Shared by the rank programs: write a file atomically (so a reader never sees it empty).
RANK_PRELUDE = """
import os, sys, time, signal, json
d = os.environ["TEST_DIR"]
rank = int(os.environ["RANK"])
def put(name, text):
    tmp = os.path.join(d, "." + name)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(d, name))
put(f"pid.{rank}", str(os.getpid()))
"""

SEEN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ZERO_LAUNCHER",
    "OMP_NUM_THREADS",
)


def test_the_launcher_imports_no_torch() -> None:
    """zero-launch runs beside the ranks and needs only the standard library: importing
    torch there cost every start 1.5-3 s on a small CPU, and ~300 MB per node."""
    probe = "import sys, zero_comm.launch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "zero_comm.launch imported torch; keep it lazy"


@pytest.mark.parametrize("n", [1, 3])
def test_all_ranks_succeed_with_the_torchrun_variables(rank_dir: Path, n: int) -> None:
    code = (
        RANK_PRELUDE
        + f"""
put(f"seen.{{rank}}", json.dumps({{k: os.environ.get(k) for k in {SEEN!r}}}))
"""
    )
    result = run_launch(launch_command(n, code), _env(rank_dir), rank_dir)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((rank_dir / f"seen.{r}").read_text()) for r in range(n)]
    ports = {s["MASTER_PORT"] for s in seen}
    assert len(ports) == 1, f"ranks were given different ports: {ports}"
    port = int(ports.pop())
    assert 0 < port < 65536
    omp = str(max(1, (os.cpu_count() or 1) // n))
    for r, s in enumerate(seen):
        assert s == {
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "ZERO_LAUNCHER": "zero-launch",
            "OMP_NUM_THREADS": omp,
        }


def test_omp_num_threads_set_by_the_user_is_kept(rank_dir: Path) -> None:
    code = RANK_PRELUDE + 'put(f"omp.{rank}", os.environ["OMP_NUM_THREADS"])\n'
    env = _env(rank_dir)
    env["OMP_NUM_THREADS"] = "7"
    result = run_launch(launch_command(2, code), env, rank_dir)
    assert result.returncode == 0, result.stderr
    assert [(rank_dir / f"omp.{r}").read_text() for r in range(2)] == ["7", "7"]


def test_a_failing_rank_stops_the_others_quickly(rank_dir: Path) -> None:
    """Rank 1 exits with 3 once ranks 0 and 2 (sleeping LONG_SLEEP s) have written their pids.

    zero-launch must exit non-zero, name rank 1, and leave no rank running, within 15 s:
    the start-up (~1.5 s) plus a poll and SIGTERM, far below the 120 s sleep.
    """
    code = (
        RANK_PRELUDE
        + f"""
if rank == 1:
    deadline = time.monotonic() + 20
    while not all(os.path.exists(os.path.join(d, f"pid.{{r}}")) for r in (0, 2)):
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.01)
    sys.exit(3)
time.sleep({LONG_SLEEP})
"""
    )
    result = run_launch(launch_command(3, code), _env(rank_dir), rank_dir)
    assert result.returncode != 0
    assert result.returncode == 3, "zero-launch passes the failing rank's exit code on"
    assert result.seconds < 15, f"took {result.seconds:.1f}s"
    assert "rank 1 exited with code 3" in result.stderr
    assert "stopped ranks [0, 2]" in result.stderr
    pids = _rank_pids(rank_dir)
    assert len(pids) == 3
    assert [pid for pid in pids if _alive(pid)] == []


def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(rank_dir: Path) -> None:
    """With ``--grace 0.5``, ranks that ignore SIGTERM are SIGKILLed half a second later."""
    code = (
        RANK_PRELUDE
        + f"""
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if rank == 0:
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(d, "pid.1")):
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.01)
    sys.exit(5)
time.sleep({LONG_SLEEP})
"""
    )
    result = run_launch(launch_command(2, code, "--grace", "0.5"), _env(rank_dir), rank_dir)
    assert result.returncode == 5
    assert result.seconds < 15, f"took {result.seconds:.1f}s"
    assert "rank 0 exited with code 5" in result.stderr
    assert [pid for pid in _rank_pids(rank_dir) if _alive(pid)] == []


def test_a_rank_killed_by_a_signal_is_reported_by_its_name(rank_dir: Path) -> None:
    code = (
        RANK_PRELUDE
        + """
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
"""
    )
    result = run_launch(launch_command(2, code), _env(rank_dir), rank_dir)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in result.stderr


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_sigterm_is_forwarded_to_every_rank(rank_dir: Path, sent: signal.Signals) -> None:
    """Each rank installs a handler that writes ``term.R`` and exits 0, then says it is
    ready. SIGTERM (or SLURM's --signal USR1) to zero-launch (only to it: ranks run in
    their own sessions) must reach every rank, and zero-launch must still exit non-zero
    (128 + the signal)."""
    n = 2
    code = (
        RANK_PRELUDE
        + f"""
def on_term(signum, frame):
    put(f"term.{{rank}}", signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.{sent.name}, on_term)
put(f"ready.{{rank}}", "")
time.sleep({LONG_SLEEP})
sys.exit(6)
"""
    )
    with open(rank_dir / "launch.err", "w+") as err:
        proc = subprocess.Popen(
            launch_command(n, code), env=_env(rank_dir), stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            wait_for_files([rank_dir / f"ready.{r}" for r in range(n)], timeout=20)
            start = time.monotonic()
            proc.send_signal(sent)
            code_ = proc.wait(timeout=10)
            seconds = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [(rank_dir / f"term.{r}").read_text() for r in range(n)] == [sent.name] * n
    assert code_ != 0
    assert code_ == 128 + sent
    assert seconds < 5, f"took {seconds:.1f}s after SIGTERM"
    assert [pid for pid in _rank_pids(rank_dir) if _alive(pid)] == []


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "not-reported"])
def test_a_code_the_command_reports_itself_gets_no_blame_line(
    rank_dir: Path, reported: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """zero-train explains a failed save itself and exits 3: launch(reported_codes={3})
    stops the other ranks, returns 3 and adds no line of its own; without it, the usual
    line names the rank."""
    from zero_comm.launch import launch

    code = RANK_PRELUDE + f"sys.exit(3) if rank == 1 else time.sleep({LONG_SLEEP})\n"
    env = _env(rank_dir)
    command = [sys.executable, "-c", textwrap.dedent(code)]
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        returned = launch(command, 2, grace=1.0, reported_codes={3} if reported else ())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert returned == 3
    err = capfd.readouterr().err
    assert ("zero-launch:" in err) is not reported, err
    assert [pid for pid in _rank_pids(rank_dir) if _alive(pid)] == []


def test_a_reported_code_from_every_rank_at_once_gets_no_blame_line(
    rank_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every rank exits 3 within the same instant (as when each names the same failed
    save): the launcher's poll loop may see them all gone before it names a failure, and
    must still treat 3 as reported (it once printed its own line after the command's)."""
    from zero_comm.launch import launch

    deadline = time.time() + 1.5  # every rank exits at this moment, give or take a ms
    code = RANK_PRELUDE + f"time.sleep(max(0.0, {deadline!r} - time.time())); sys.exit(3)\n"
    saved = dict(os.environ)
    os.environ.update(_env(rank_dir))
    try:
        returned = launch(
            [sys.executable, "-c", textwrap.dedent(code)], 2, grace=1.0, reported_codes={3}
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert returned == 3
    err = capfd.readouterr().err
    assert "zero-launch:" not in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "0", "true"], "-n must be at least 1, got 0"),
        (["-n", "-2", "true"], "-n must be at least 1, got -2"),
        (["-n", "2"], "no command given"),
        (["-n", "2", "--"], "no command given"),
        (["-n", "two", "true"], "invalid int value"),
        # Each was a FileNotFoundError / PermissionError traceback (found by probing).
        (["-n", "2", "no_such_program_xyz"], "no_such_program_xyz is not found on PATH"),
        (["-n", "2", "/no/such/program"], "/no/such/program is not found: give a program"),
        (["-n", "2", "/tmp"], "/tmp is not an executable file"),
        (["-n", "2", "--grace", "-1", "true"], "--grace -1.0 must be seconds >= 0"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process: argparse's usage errors exit 2 before anything is started."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: zero-launch" in err


def test_a_file_that_cannot_run_is_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Not executable: one usage line before anything starts, exit 2. Executable but not
    a program (no #! line): each rank says so in one line, exit 127, and zero-launch adds
    nothing (it was an OSError traceback once)."""
    plain = tmp_path / "notes.txt"
    plain.write_text("hello\n")
    with pytest.raises(SystemExit) as info:
        main(["-n", "2", str(plain)])
    assert info.value.code == 2
    assert f"{plain} is not an executable file" in capfd.readouterr().err
    bare = tmp_path / "bare"
    bare.write_text("hello\n")
    bare.chmod(0o755)
    assert launch([str(bare)], 2) == 127
    err = capfd.readouterr().err.strip().splitlines()
    # One line per rank that got that far: the first one's exit stops the other, which may
    # not have reached its exec yet.
    line = f"zero-launch: {bare} cannot be started: Exec format error"
    assert err in ([line], [line, line]), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_the_launcher_ends_every_rank(rank_dir: Path) -> None:
    """SIGKILL to zero-launch (a scheduler's cleanup, a user's kill -9), which can forward
    nothing: every rank is gone within seconds, not left training and writing (a probe's
    ranks ran 3 minutes more and wrote into --out)."""
    code = RANK_PRELUDE + f"time.sleep({LONG_SLEEP})\n"
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", sys.executable, "-c", code], env=_env(rank_dir),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for_files([rank_dir / "pid.0", rank_dir / "pid.1"], timeout=LAUNCH_TIMEOUT)
    pids = _rank_pids(rank_dir)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [pid for pid in pids if _alive(pid)], "ranks outlived their launcher by 5 s"


def test_usage_error_as_a_command() -> None:
    """The same as a command: exit 2, message on stderr, nothing started."""
    cmd = [*LAUNCH, "-n", "0", sys.executable, "-c", "pass"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 2
    assert "-n must be at least 1" in proc.stderr


def test_double_dash_separates_the_command(rank_dir: Path) -> None:
    """``zero-launch -n 1 -- python -c CODE -n 5``: everything after ``--`` is the rank's."""
    code = RANK_PRELUDE + 'put("argv", json.dumps(sys.argv[1:]))\n'
    cmd = [*LAUNCH, "-n", "1", "--"]
    cmd += [sys.executable, "-c", code, "-n", "5"]
    result = run_launch(cmd, _env(rank_dir), rank_dir)
    assert result.returncode == 0, result.stderr
    assert json.loads((rank_dir / "argv").read_text()) == ["-n", "5"]


# ------------------------------------------------------------------ pure helpers


@pytest.mark.parametrize("sig", list(signal.Signals), ids=lambda s: s.name)
def test_describe_exit_names_every_signal(sig: signal.Signals) -> None:
    assert describe_exit(-sig.value) == f"was killed by {sig.name}"


def test_describe_exit_of_an_unknown_signal() -> None:
    assert describe_exit(-200) == "was killed by signal 200"


@pytest.mark.parametrize("code", [1, 3, 127, 255])
def test_describe_exit_of_an_exit_code(code: int) -> None:
    assert describe_exit(code) == f"exited with code {code}"


def test_rank_environment_does_not_change_its_base() -> None:
    base = {"PATH": "/bin", "RANK": "9"}
    env = rank_environment(base, 2, 4, 12345)
    assert base == {"PATH": "/bin", "RANK": "9"}
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "4", "12345")
    assert env["PATH"] == "/bin"
