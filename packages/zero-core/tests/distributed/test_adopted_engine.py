"""zero_core on an adopted world (zero_comm.from_process_group over a default group the
script made with torch.distributed.init_process_group) trains to the same bits as on a
world zero_comm.init made: stage 3, 2 steps, 2 gloo ranks (adopt_engine_rank.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_comm.launch import free_port, rank_environment

RANK_SCRIPT = str(Path(__file__).parent / "adopt_engine_rank.py")


def start_ranks(case: str, folder: Path) -> list[subprocess.Popen[str]]:
    port = free_port()
    threads = str(torch.get_num_threads())
    return [
        subprocess.Popen(
            [sys.executable, RANK_SCRIPT, case, str(folder)],
            env=rank_environment(dict(os.environ, OMP_NUM_THREADS=threads), rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]


def finish(procs: list[subprocess.Popen[str]]) -> None:
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
        assert proc.returncode == 0, f"rank {rank} exit {proc.returncode}:\n{out[-3000:]}"


@pytest.mark.gloo
@pytest.mark.timeout(200)
def test_an_adopted_world_trains_to_the_bits_of_a_fresh_one(tmp_path: Path) -> None:
    both = start_ranks("fresh", tmp_path) + start_ranks("adopted", tmp_path)  # two jobs at once
    finish(both[:2])
    finish(both[2:])
    for stage in (3,):
        fresh = torch.load(tmp_path / f"fresh-stage{stage}.pt")
        adopted = torch.load(tmp_path / f"adopted-stage{stage}.pt")
        assert fresh.keys() == adopted.keys() and fresh
        for name, value in fresh.items():
            assert torch.equal(adopted[name], value), f"stage {stage}: {name} differs"
