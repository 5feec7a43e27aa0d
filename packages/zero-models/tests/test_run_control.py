"""zero-train's run control: signals (preemption, Ctrl-C), the results folder a live run
holds, and a stuck peer named within --heartbeat-timeout or --comm-timeout; each test runs
real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import losses_of, run

import zero_core


def test_sigterm_saves_exits_75_and_resume_auto_continues_bit_for_bit(tmp_path: Path) -> None:
    """SLURM's preemption: SIGTERM to zero-train (which relays it to its ranks) finishes
    the step on every rank, saves OUT/checkpoint and exits 75; the same command with
    --resume auto then ends exactly (every loss) like a run that was never stopped."""
    import signal
    import time

    common = ["--model", "test", "--steps", "60", "--batch-size", "4", "--sample-tokens", "4",
              "--threads", "1"]  # fmt: skip
    straight = run(*common, "--out", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    command = [sys.executable, "-m", "zero_models.train", *common, "--out", "job"]
    job = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = tmp_path / "job" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 6
    ):
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr[-2000:]
    assert "SIGTERM received: stopped after step" in stdout and "--resume auto" in stdout
    assert "zero-launch" not in stderr  # the ranks ended alike: no blame line
    saved = zero_core.complete_checkpoint(tmp_path / "job/checkpoint")
    assert saved is not None
    stopped_at = json.loads((saved / "index.json").read_text())["extra"]["step"]
    assert 5 <= stopped_at < 60
    requeued = run(*common, "--out", "job", "--resume", "auto", cwd=tmp_path)
    assert requeued.returncode == 0, requeued.stderr
    assert f"at step {stopped_at}" in requeued.stdout
    assert losses_of(tmp_path / "job/metrics.jsonl") == losses_of(
        tmp_path / "straight/metrics.jsonl"
    )


def test_a_second_preemption_signal_ends_the_process_at_once() -> None:
    """The first SIGUSR1 is recorded (the step finishes, then the run saves); the second
    ends the process as if unhandled, with one line: a step that never ends no longer
    leaves it deaf to the signal (a --context 1000000 probe ignored timeout's SIGTERM)."""
    code = (
        "import os, signal\n"
        "from zero_models.trainer import PreemptionFlag\n"
        "flag = PreemptionFlag([signal.SIGUSR1])\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('recorded', flag.received.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('still running', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.stdout == "recorded SIGUSR1\n"
    assert result.returncode == -signal.SIGUSR1
    assert result.stderr.strip() == "zero-train: SIGUSR1 again: stopping now, without saving"


def test_one_live_run_per_results_folder(tmp_path: Path) -> None:
    """A live run holds OUT's lock: another run into OUT is refused before it touches
    anything, naming the holder, even with --overwrite or --resume auto (two runs started
    together once interleaved metrics.jsonl and died; with other seeds one replaced the
    other's results). SIGKILL frees the lock (the kernel's flock); the next run takes it
    over, saying once that its holder ended without letting go."""
    from zero_models.run_lock import RunLock, holder_of
    from zero_models.train_options import parse_options

    out = tmp_path / "o"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from zero_models.run_lock import RunLock\nheld = RunLock(Path(sys.argv[1]))\n"
         "print('held', flush=True)\ntime.sleep(120)\n", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert holder_of(out).startswith(f"the run of pid {holder.pid} on ")
        for extra in ([], ["--overwrite"], ["--resume", "auto"]):
            with pytest.raises(SystemExit) as stop:
                parse_options(["--out", str(out), *extra])
            assert stop.value.code == 2
    finally:
        holder.kill()
        holder.wait()
    assert holder_of(out) == ""
    lock = RunLock(out)
    assert lock.took_over.startswith(f"the run of pid {holder.pid} on ")
    lock.release()
    again = RunLock(out)
    assert again.took_over == ""  # a run that ended well leaves no holder behind
    again.release()


def test_ctrl_c_stops_every_rank_at_once_in_one_line(tmp_path: Path) -> None:
    """SIGINT to zero-train (Ctrl-C): every rank ends within seconds, the run prints one
    line and exits 130, and the ranks' swap folders are gone. It printed 55-79 lines of
    KeyboardInterrupt and c10d frames, and took 11-15 s while ranks waited in collectives
    for peers already gone."""
    (tmp_path / "swap").mkdir()
    out = tmp_path / "interrupted"
    command = [sys.executable, "-m", "zero_models.train", "--model", "test", "--steps", "5000",
               "--sample-tokens", "1", "--offload-optimizer", "disk", "--offload-dir",
               str(tmp_path / "swap"), "--out", str(out)]  # fmt: skip
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert run.stdout is not None
    while not run.stdout.readline().startswith("step "):  # training, swap files written
        assert run.poll() is None, run.communicate()
    run.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = run.communicate(timeout=60)
    assert time.monotonic() - start < 5, "the ranks took more than 5 s to stop"
    assert run.returncode == 130
    assert err.strip().splitlines() == [
        "zero-train: interrupted (SIGINT): stopped without saving; SIGTERM or SIGUSR1 "
        "makes every rank finish its step and save first"
    ]
    assert not list((tmp_path / "swap").iterdir())
    assert not processes_naming(str(out))


def processes_naming(text: str) -> list[int]:
    """The pids of this host's processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:  # ended while we looked
            continue
    return found


@pytest.mark.parametrize(
    "option",
    ["--heartbeat-timeout", pytest.param("--comm-timeout", marks=pytest.mark.slow)],
)
def test_a_stopped_peer_is_named_within_seconds(tmp_path: Path, option: str) -> None:
    """kill -STOP of rank 1: rank 0 stops in one line naming rank 1 as stopped, within
    seconds (a probe met 316 s, and the line said "Every rank on this host is still
    running"). With --heartbeat-timeout 3 (the collective timeout left at 300 s) the
    heartbeat names it: it has not beaten for 3 s; with --comm-timeout 3 (the heartbeat
    timeout left at 60 s) the collective times out, and the line says it is stopped."""
    out = tmp_path / "stuck"
    command = [sys.executable, "-m", "zero_models.train", "--model", "test", "--steps", "100000",
               "--sample-tokens", "1", option, "3", "--out", str(out)]  # fmt: skip
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert run.stdout is not None
    while not run.stdout.readline().startswith("step "):
        assert run.poll() is None, run.communicate()
    ranks = sorted(pid for pid in processes_naming(str(out)) if pid != run.pid)
    assert len(ranks) == 2, ranks
    stopped = ranks[-1]  # started second: rank 1
    os.kill(stopped, signal.SIGSTOP)
    try:
        start = time.monotonic()
        _, err = run.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):  # zero-launch may have ended it
            os.kill(stopped, signal.SIGKILL)
    assert run.returncode == 3 and took < 30, (run.returncode, took, err)
    last = err.strip().splitlines()[-1]
    if option == "--comm-timeout":
        assert "CommTimeoutError" in last and "within 3.0s" in last, last
        assert f"rank 1 (pid {stopped}) is stopped" in last, last
    else:
        assert "PeerFailureError" in last, last
        assert f"pid {stopped}) has sent no heartbeat for" in last, last
        assert f"it is stopped (SIGSTOP or Ctrl-Z: kill -CONT {stopped} to go on)" in last, last
