"""One rank of a 2-rank job that trains a small MLP for a few steps at stage 3 (it
gathers and reduce-scatters), on a world zero_comm made or on one the script made itself
(test_adopted_engine.py starts both ranks by hand, torchrun-style variables):

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python adopt_engine_rank.py CASE DIR

CASE ``fresh``: ``zero_comm.init(deterministic=True)``. ``adopted``: the script calls
``torch.distributed.init_process_group("gloo")`` and ``zero_comm.from_process_group()``.
Rank 0 saves each stage's full state after the steps to DIR/<case>-stage<k>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_comm
import zero_core

STEPS = 2


def train(comm: zero_comm.Communicator, stage: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 15), nn.Tanh(), nn.Linear(15, 7))  # awkward shapes
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    engine = zero_core.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero_core.ZeroConfig(stage=stage),
        comm,
    )
    for step in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + comm.rank))
        engine.backward(engine(x).square().mean())
        engine.step()
    state: dict[str, torch.Tensor] = engine.full_state_dict()
    engine.close()
    return state


def main() -> int:
    case, folder = sys.argv[1], Path(sys.argv[2])
    if case == "fresh":
        comm = zero_comm.init(deterministic=True, timeout=60.0)
    else:
        dist.init_process_group("gloo")
        comm = zero_comm.from_process_group(timeout=60.0)
    for stage in (3,):
        state = train(comm, stage)
        if comm.rank == 0:
            torch.save(state, folder / f"{case}-stage{stage}.pt")
    comm.close()
    if case == "adopted":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
