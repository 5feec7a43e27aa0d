"""One tiny stage-3 fit on 2 CPU ranks, for test_lightning_slurm.py: run as
``python slurm_run.py OUT`` under Lightning's own launcher (rank 0 re-runs this script as
rank 1), or started once per task with the environment ``srun`` gives each task.

The fit is lightning_runs.py's ``zero3`` (per-step schedule, gradient_clip_val=0.5); its
parameters and losses go to ``OUT/zero3.pt`` (rank 0). Each rank then prints one line,
``slurm_run: environment=... rank=... world_size=... process_group=... comm=... topology=...``,
saying which cluster environment Lightning chose and which world the rank joined.

Under SLURM only, SLURM's own resume path follows: 2 epochs at once (``zero3_whole``), then
1 epoch whose checkpoint is saved as ``ROOT/hpc_ckpt_1.ckpt`` (the name Lightning's
requeue handler gives it) and a new fit of 2 epochs with no ``ckpt_path`` in the same
``default_root_dir`` (``zero3_hpc``): Lightning resumes it from that checkpoint by itself
because it runs under SLURM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning_runs import fit

from zero_core.lightning import ZeroStrategy


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    strategy = ZeroStrategy(stage=3)
    trainer = fit(out, "zero3", strategy, gradient_clip_val=0.5)
    comm = strategy.comm
    assert comm is not None
    line = (
        f"slurm_run: environment={type(strategy.cluster_environment).__name__} "
        f"rank={trainer.global_rank} world_size={trainer.world_size} "
        f"process_group={dist.get_rank()}/{dist.get_world_size()} "
        f"comm={comm.rank}/{comm.world_size} "
        f"topology={comm.topology.source}:{list(comm.topology.node_of)}"
    )
    # One write(2) of under PIPE_BUF bytes: under Lightning's launcher both ranks share
    # one pipe, and print's separate writes of text and newline interleave.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())
    if isinstance(strategy.cluster_environment, SLURMEnvironment):
        root = out / "root"
        fit(out, "zero3_whole", ZeroStrategy(stage=3), max_epochs=2)
        first = fit(out, "zero3_first", ZeroStrategy(stage=3), max_epochs=1, default_root_dir=root)
        first.save_checkpoint(str(root / "hpc_ckpt_1.ckpt"))
        fit(out, "zero3_hpc", ZeroStrategy(stage=3), max_epochs=2, default_root_dir=root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
