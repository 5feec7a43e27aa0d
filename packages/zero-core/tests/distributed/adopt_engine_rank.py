"""One rank of a 2-rank job that trains a small MLP for a few steps at stage 3 (it
gathers and reduce-scatters) twice: on a world zero_comm makes, then, once that is closed,
on a world the script makes itself and zero_comm adopts (test_adopted_engine.py starts
both ranks by hand, torchrun-style variables; PORT is a second free port):

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python adopt_engine_rank.py DIR PORT

Rank 0 saves each run's full state after the steps to DIR/fresh.pt and DIR/adopted.pt.
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


def train(comm: zero_comm.Communicator) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 15), nn.Tanh(), nn.Linear(15, 7))  # awkward shapes
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    engine = zero_core.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero_core.ZeroConfig(stage=3),
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
    folder, port = Path(sys.argv[1]), int(sys.argv[2])
    comm = zero_comm.init(deterministic=True, timeout=60.0)
    rank, fresh = comm.rank, train(comm)
    comm.close()  # zero_comm's world is gone: the script's own comes next
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = zero_comm.from_process_group(timeout=60.0)
    adopted = train(comm)
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(fresh, folder / "fresh.pt")
        torch.save(adopted, folder / "adopted.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
