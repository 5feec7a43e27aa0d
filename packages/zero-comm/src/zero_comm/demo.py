"""A collectives demo across local ranks: ``zero-launch -n 2 python -m zero_comm.demo``.

Each rank contributes rank-dependent data; rank 0 prints what every collective returned,
checks the deterministic all-reduce against the same sum done in one process, and reports
the ring-convention volume that the communicator counted.
"""

from __future__ import annotations

import argparse
import functools
import operator
import time

import torch

import zero_comm


def contribution(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--numel", type=int, default=1_000_003)
    args = parser.parse_args()
    comm = zero_comm.init(args.backend, deterministic=True, timeout=60)
    size, rank = comm.world_size, comm.rank

    grads = contribution(rank, args.numel)
    start = time.perf_counter()
    comm.all_reduce(grads)
    elapsed = time.perf_counter() - start
    expected = functools.reduce(operator.add, (contribution(r, args.numel) for r in range(size)))

    chunk = args.numel // size
    shard = torch.empty(chunk)
    comm.reduce_scatter(shard, contribution(rank, chunk * size))
    gathered = torch.empty(chunk * size)
    comm.all_gather(gathered, shard)
    names = comm.all_gather_object(f"rank {rank} ({comm.backend}, {comm.device})")

    if rank == 0:
        print(f"zero_comm demo: {size} ranks: {', '.join(names)}")
        print(
            f"all_reduce of {args.numel:,} floats: {elapsed * 1e3:.1f} ms, bit-identical to "
            f"the rank-order sum in one process: {torch.equal(grads, expected)}"
        )
        print(
            f"reduce_scatter + all_gather of {chunk * size:,} floats round-trip: "
            f"{gathered.shape[0]:,} elements"
        )
        for name, counts in comm.stats.as_dict().items():
            if counts["calls"]:
                print(
                    f"  {name:15s} calls={counts['calls']:<3d} "
                    f"ring volume={counts['volume_bytes'] / 1e6:8.2f} MB"
                )
    comm.barrier()
    comm.close()


if __name__ == "__main__":
    main()
