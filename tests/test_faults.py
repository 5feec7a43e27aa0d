"""A rank killed for real (SIGKILL) in forward, backward, a collective, the optimizer step,
the disk tier's swap pipeline or a checkpoint save: the others stop at once naming it, the
launchers exit non-zero naming it, and the last complete checkpoint resumes bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zero_comm
import zero_core
from zero_comm import run_simulated
from zero_comm.launch import free_port, rank_environment
from zero_comm.testing import find_mpiexec, is_open_mpi
from zero_core.component_access import disk_swap
from zero_models.run_metrics import read_metrics

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fault_rank import (  # noqa: E402
    KILL_STEP,
    ON_DISK,
    SWAP_KILL_KEY,
    WHERE,
    build,
    expected_state,
    train_step,
)

TIMEOUT_S = 10.0


def start_ranks(where: str, folder: Path, world_size: int = 3) -> list[subprocess.Popen[str]]:
    """The ranks of one job, started directly (no launcher to stop the survivors)."""
    port = free_port()
    env = dict(os.environ)  # the test run's thread count (conftest.py)
    command = [sys.executable, str(HERE / "fault_rank.py"), "--where", where,
               "--folder", str(folder), "--timeout", str(TIMEOUT_S)]  # fmt: skip
    return [
        subprocess.Popen(
            command,
            env=rank_environment(env, rank, world_size, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]


def names_dead_rank_1(message: str, pid: int | str) -> bool:
    """The message names rank 1 as dead: "rank 1 (pid N) is dead", or with its host where
    the peers know it ("rank 1 (host H, pid N) is dead")."""
    return re.search(rf"rank 1 \((host \S+, )?pid {pid}\) is dead", message) is not None


def survivors_name_the_killed_rank(where: str, folder: Path) -> int:
    """Run fault_rank.py's 3 ranks with rank 1 killed at ``where``: rank 1 dies by SIGKILL,
    and ranks 0 and 2 exit 3 naming it within the timeout. Returns the victim's pid."""
    processes = start_ranks(where, folder)
    outputs = [p.communicate(timeout=120) for p in processes]
    victim_pid = int((folder / "killed_at").read_text().split()[1])
    assert processes[1].returncode == -signal.SIGKILL, outputs[1][1][-2000:]
    for rank in (0, 2):
        assert processes[rank].returncode == 3, outputs[rank][1][-2000:]
        report = json.loads(outputs[rank][0].strip().splitlines()[-1])
        assert report["error"] in ("PeerFailureError", "CommTimeoutError"), report
        assert names_dead_rank_1(report["message"], victim_pid), report
        assert report["after_kill_s"] < TIMEOUT_S + 2, report
    return victim_pid


# The default test run keeps one point (a collective failing mid-backward; zero-train's own
# fault test below kills a rank too); `nox -s faults` runs them all, the save included.
SLOW = pytest.mark.faults


@pytest.mark.gloo
@pytest.mark.parametrize(
    "where",
    [w if w == "backward" else pytest.param(w, marks=SLOW) for w in WHERE if w not in ON_DISK],
)
def test_every_survivor_names_the_killed_rank_and_the_last_checkpoint_resumes(
    where: str, tmp_path: Path
) -> None:
    survivors_name_the_killed_rank(where, tmp_path)
    # The checkpoint on disk is complete (whatever step it is from) and resumes exactly.
    resumed = run_simulated(3, lambda comm: expected_state(comm, 6, tmp_path / "ckpt"))[0]
    straight = run_simulated(3, lambda comm: expected_state(comm, 6, None))[0]
    unequal = [k for k in straight if not torch.equal(resumed[k], straight[k])]
    if unequal:  # say whether the uninterrupted run itself repeats (it failed once in CI)
        again = run_simulated(3, lambda comm: expected_state(comm, 6, None))[0]
        repeats = all(torch.equal(again[k], straight[k]) for k in straight)
        resumed_is_again = all(torch.equal(again[k], resumed[k]) for k in straight)
        raise AssertionError(
            f"resumed != uninterrupted in {unequal}; a second uninterrupted run equals the "
            f"first: {repeats}, equals the resumed one: {resumed_is_again}"
        )


def swap_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> contents)."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


# 20-35 s on 2 cores, nearly all of it starting the 3 ranks (the four in-process runs take
# ~3 s): with the faults, not in the default run.
@pytest.mark.gloo
@SLOW
@pytest.mark.parametrize("where", ON_DISK)
def test_a_rank_killed_mid_swap_resumes_bit_for_bit_from_fresh_swap_files(
    where: str, tmp_path: Path
) -> None:
    """Every rank's masters, Adam states, gradients and parameter shards on disk
    (fault_rank.build); rank 1 dies in step 3's swap pipeline (``swap``: its 3rd tile's
    exp_avg write landed, the tile's other writes and the next tiles' reads in flight) or
    in step 3's backward as its gradients are swapped out (``grad_swap``: its 3rd tile's
    gradient block written, the rest not). The survivors name it; its swap files stay
    behind, half written (theirs are removed as they exit). The checkpoint of step 3
    resumes on the disk tiers, with fresh swap files (the left-over ones, torn gradient
    blocks included, are neither read nor changed), and without them: both end bitwise
    equal to an uninterrupted run, on the disk tiers or not (the tiers are exact:
    torch.equal)."""
    victim_pid = survivors_name_the_killed_rank(where, tmp_path)
    swap, checkpoint = tmp_path / "swap", tmp_path / "ckpt"
    found = zero_core.complete_checkpoint(checkpoint)  # the tag that ckpt/latest names
    assert found is not None
    saved = json.loads((found / "index.json").read_text())["extra"]["steps"]
    assert saved == KILL_STEP  # the save before the step it died in
    left = swap_files(swap)
    victims = {Path(name).parts[0] for name in left}
    assert victims == {f"zero-swap.rank1.pid{victim_pid}.0"}, sorted(left)
    assert any(name.endswith(f".{SWAP_KILL_KEY[where]}.swap") for name in left), sorted(left)

    def resume_on_disk(comm: zero_comm.Communicator) -> dict[str, torch.Tensor]:
        engine = build(comm, swap)
        fresh = disk_swap(engine).folder
        assert fresh.name not in victims and any(fresh.iterdir())
        for step in range(engine.load(checkpoint)["steps"], 6):
            train_step(engine, step)
        state = engine.full_state_dict()
        engine.close()
        assert not fresh.exists()
        return state

    on_disk = run_simulated(3, resume_on_disk)[0]
    on_device = run_simulated(3, lambda comm: expected_state(comm, 6, checkpoint))[0]
    runs = {"resumed on disk": on_disk, "resumed on the device": on_device}
    assert swap_files(swap) == left, "the left-over swap files are not consumed"
    runs["straight on disk"] = run_simulated(
        3, lambda comm: expected_state(comm, 6, None, tmp_path / "straight")
    )[0]
    straight = run_simulated(3, lambda comm: expected_state(comm, 6, None))[0]
    for name, state in runs.items():
        assert state.keys() == straight.keys()
        unequal = [k for k in straight if not torch.equal(state[k], straight[k])]
        assert not unequal, f"{name} differs from the uninterrupted run on the device: {unequal}"


@pytest.mark.gloo
def test_zero_launch_stops_the_job_naming_the_killed_rank(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "zero_comm.launch", "-n", "3", sys.executable,
         str(HERE / "fault_rank.py"), "--where", "step", "--folder", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "zero-launch: rank 1 was killed by SIGKILL; stopped ranks [0, 2]" in result.stderr
    assert time.monotonic() - started < 60


def run_under_mpiexec(
    folder: Path, *flags: str, into: Path | None = None, where: str = "backward"
) -> tuple[int, str]:
    """fault_rank.py on 3 MPI ranks under mpiexec (rank 1 killed at ``where``): the exit
    status and everything the job printed (through a pipe, or a file when ``into``)."""
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    if is_open_mpi(mpiexec):
        flags = ("--oversubscribe", *flags)  # 3 ranks on 2 cores
    command = [mpiexec, *flags, "-n", "3", sys.executable, "-m", "mpi4py",
               str(HERE / "fault_rank.py"), "--backend", "mpi", "--where", where,
               "--folder", str(folder)]  # fmt: skip
    started = time.monotonic()
    if into is None:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        returncode, output = result.returncode, result.stdout + result.stderr
    else:
        with into.open("w") as sink:
            returncode = subprocess.run(command, stdout=sink, stderr=sink, timeout=120).returncode
        deadline = time.monotonic() + 35  # the watchdog appends once mpiexec is gone
        while "zero-comm:" not in into.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        output = into.read_text()
    assert time.monotonic() - started < 60
    assert (folder / "killed_at").exists()
    # The checkpoint on disk is complete (whatever step it is from) and resumes exactly.
    resumed = run_simulated(3, lambda comm: expected_state(comm, 6, folder / "ckpt"))[0]
    straight = run_simulated(3, lambda comm: expected_state(comm, 6, None))[0]
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    return returncode, output


MPIEXEC = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec")
OPEN_MPI = find_mpiexec() is not None and is_open_mpi(str(find_mpiexec()))
# What the launcher prints when a rank dies: MPICH's hydra, or Open MPI's prterun.
LAUNCHER_SAYS = "prterun noticed that process rank 1" if OPEN_MPI else "BAD TERMINATION"


@pytest.mark.mpi
@MPIEXEC
@pytest.mark.parametrize(
    ("where", "into_file"),
    [("backward", False), ("backward", True)]
    + [pytest.param(w, False, marks=SLOW) for w in WHERE if w != "backward"],
    ids=lambda v: {False: "pipe", True: "file"}.get(v, v) if isinstance(v, bool) else v,
)
def test_under_mpiexec_the_host_watchdog_names_the_killed_rank(
    tmp_path: Path, where: str, into_file: bool
) -> None:
    """MPICH's mpiexec (hydra) SIGKILLs the other ranks at once, and its "BAD TERMINATION
    ... PID p" may name one of those (Open MPI's prterun kills them too, naming the dead
    rank): the host's watchdog names the rank that died first, wherever it died (forward,
    backward, inside a collective, the step, a save)."""
    returncode, output = run_under_mpiexec(
        tmp_path, into=tmp_path / "job.log" if into_file else None, where=where
    )
    victim_pid = int((tmp_path / "killed_at").read_text().split()[1])
    assert returncode != 0
    assert LAUNCHER_SAYS in output, output[-3000:]
    named = f"zero-comm: rank 1 (pid {victim_pid}, host {socket.gethostname()}) ended without"
    assert named in output, output[-3000:]
    assert "ranks [0, 2] were still running" in output


# In `nox -s faults`, not the default run: under heavy load (two CI runs at once) hydra's
# SIGKILL of the job once the first survivor exits outran every survivor's report once.
@pytest.mark.mpi
@SLOW
@MPIEXEC
@pytest.mark.skipif(OPEN_MPI, reason="-disable-auto-cleanup is MPICH hydra's; prterun has none")
def test_under_mpiexec_without_auto_cleanup_every_survivor_names_the_killed_rank(
    tmp_path: Path,
) -> None:
    """With -disable-auto-cleanup hydra lets the survivors live and signals them (SIGUSR1):
    a survivor raises PeerFailureError naming the dead rank, as on gloo. Hydra still
    SIGKILLs the rest of the job as soon as the first survivor exits, which often comes
    before the second one has printed: so at least one report, and every report names it."""
    returncode, output = run_under_mpiexec(tmp_path, "-disable-auto-cleanup")
    victim_pid = int((tmp_path / "killed_at").read_text().split()[1])
    assert returncode != 0
    # Hydra forwards output in pieces: its own message may follow a report on the same line.
    decode = json.JSONDecoder().raw_decode
    reports = [decode(line)[0] for line in output.splitlines() if line.startswith("{")]
    assert reports and {r["rank"] for r in reports} <= {0, 2}, output[-3000:]
    for report in reports:
        assert report["error"] == "PeerFailureError", report
        assert names_dead_rank_1(report["message"], victim_pid), report
        assert report["after_kill_s"] < 5, report


def rank_pid(out: Path, rank: int) -> int | None:
    """The pid of zero-train's rank ``rank`` writing to ``out`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (str(out).encode() in command and b"zero_models.train" in command
                and f"RANK={rank}".encode() in environ):  # fmt: skip
            return int(entry.name)
    return None


@pytest.mark.gloo
def test_zero_train_stops_naming_a_killed_rank_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    common = [sys.executable, "-m", "zero_models.train", "--model", "test", "--batch-size", "4",
              "--sample-tokens", "4"]  # fmt: skip
    run = subprocess.Popen([*common, "--steps", "100000", "--save-every", "2", "--out", "a"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "a/checkpoint/latest").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = rank_pid(tmp_path / "a", 1) or rank_pid(Path("a"), 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = run.communicate(timeout=120)
    assert run.returncode != 0 and time.monotonic() - killed < 30
    assert "zero-launch: rank 1 was killed by SIGKILL" in stderr, stderr[-2000:]
    saved = zero_core.complete_checkpoint(tmp_path / "a/checkpoint")
    assert saved is not None
    steps = json.loads((saved / "index.json").read_text())["extra"]["step"]
    resumed = subprocess.run([*common, "--steps", str(steps + 3), "--resume", "a/checkpoint",
                              "--out", "b"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = subprocess.run([*common, "--steps", str(steps + 3), "--out", "c"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]

    def losses(out: str) -> list[float]:
        return [r["loss"] for r in read_metrics(tmp_path / out / "metrics.jsonl")[1]]

    assert losses("b") == losses("c")[steps:]
