#!/usr/bin/env python
"""The cost of the grouping-independent gradient sum (zero_comm.hierarchy) against the
native hierarchical sum and against the flat reduce-scatter, for hybrid sharding's
gradient reduction: each rank reduces a bucket of B float32 elements and keeps B / S.

    exact chain   all_to_all in the shard group, the fold carried replica to replica,
                  the result broadcast back (equals the flat sum bit for bit)
    native        reduce_scatter in the shard group, then all_reduce across replicas
                  (gloo's own order: depends on the grouping)
    flat exact    the world's deterministic reduce_scatter of B (B / N per rank)

Run under a launcher, one shard group per node, e.g. on the emulated cluster:

    python -m tools.cluster.emulated run --rate 300mbit -- -m tools.micro.hierarchy

Rank 0 prints one JSON line: per variant and size, the median and spread of the seconds
over ``--repeats`` calls (variants interleaved call by call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import zero_comm
from zero_comm.hierarchy import HybridGroups

VARIANTS = ("exact chain", "native", "flat exact")


def groups(world: zero_comm.Communicator, shard: int, deterministic: bool) -> HybridGroups:
    """Hybrid groups whose sub-communicators sum in rank order or natively."""
    saved = world.deterministic
    world.deterministic = deterministic  # the splits inherit it
    try:
        return HybridGroups(world, shard)
    finally:
        world.deterministic = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="262144,1048576,4194304", help="bucket elements B")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shard-group", type=int, help="S (default: the ranks per node)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = zero_comm.init(deterministic=True)
    shard = args.shard_group or world.topology.ranks_per_node or world.world_size
    exact, native = groups(world, shard, True), groups(world, shard, False)
    n = world.world_size
    results: dict[str, dict[str, list[float]]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        size -= size % n
        bucket = torch.randn(size, generator=torch.Generator().manual_seed(world.rank))
        out_group, out_flat = torch.empty(size // shard), torch.empty(size // n)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats + 1):
            for name in VARIANTS:
                world.barrier()
                start = time.perf_counter()
                if name == "flat exact":
                    world.reduce_scatter(out_flat, bucket)
                else:
                    (exact if name == "exact chain" else native).reduce_scatter(
                        out_group, bucket
                    ).wait()
                elapsed = time.perf_counter() - start
                if repeat:  # the first round warms the buffers up
                    times[name].append(elapsed)
        results[str(size)] = times
    if world.rank == 0:
        summary = {
            size: {
                name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
                for name, t in times.items()
            }
            for size, times in results.items()
        }
        print(
            "BENCH_HIERARCHY "
            + json.dumps({
                "ranks": n, "shard_group": shard, "nodes": world.topology.num_nodes,
                "topology": str(world.topology), "host": os.uname().nodename,
                "results": summary,
            }),
            flush=True,
        )  # fmt: skip
    world.close()


if __name__ == "__main__":
    main()
