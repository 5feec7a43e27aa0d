"""gloo's all-gather against one broadcast per rank, on raw torch.distributed.

Why: TorchCommunicator runs a gloo all-gather of at least GLOO_GATHER_BY_BROADCAST_BYTES
per rank as one broadcast per rank into the output's chunks, because gloo's all-gather
receives into a fresh temporary as large as the output and copies out of it. This measures
both paths, interleaved, per size; wall time and the process's CPU time (all threads) per
call, medians over rounds, on rank 0.

    zero-launch -n 2 python -m tools.micro.gather_paths [--rounds 7] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

SIZES = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]  # float32 elements per rank


def gather_native(out: torch.Tensor, shard: torch.Tensor) -> None:
    dist.all_gather_into_tensor(out, shard)


def gather_by_broadcasts(out: torch.Tensor, shard: torch.Tensor) -> None:
    chunks = out.view(dist.get_world_size(), -1)
    chunks[dist.get_rank()].copy_(shard)
    works = [dist.broadcast(chunks[src], src, async_op=True) for src in range(len(chunks))]
    for work in works:
        work.wait()


PATHS = {"all_gather": gather_native, "broadcasts": gather_by_broadcasts}


def timed(path, out: torch.Tensor, shard: torch.Tensor, calls: int) -> tuple[float, float]:
    """Milliseconds of wall and CPU time per call, over ``calls`` calls after a barrier."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        path(out, shard)
    dist.barrier()
    return (
        (time.perf_counter() - wall) / calls * 1e3,
        (time.process_time() - cpu) / calls * 1e3,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [
        f"gloo, {world} ranks, float32, 1 thread per rank; ms per call on rank 0, median "
        f"over {args.rounds} interleaved rounds (lowest-highest); CPU is the process's, all "
        "threads.",
        "",
        "| elements per rank | all-gather wall | broadcasts wall | wall ratio | "
        "all-gather CPU | broadcasts CPU |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for numel in SIZES:
        shard = torch.full((numel,), float(rank))
        out = torch.empty(world * numel)
        expected = torch.arange(world, dtype=torch.float32).repeat_interleave(numel)
        calls = max(3, (1 << 22) // numel // 4)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
        for _ in range(args.rounds):
            for name, path in PATHS.items():
                path(out, shard)  # warm
                assert torch.equal(out, expected), name
                results[name].append(timed(path, out, shard, calls))
        walls = {n: statistics.median(w for w, _ in r) for n, r in results.items()}
        cpus = {n: statistics.median(c for _, c in r) for n, r in results.items()}
        pairs = zip(results["all_gather"], results["broadcasts"], strict=True)
        ratios = [native[0] / broadcasts[0] for native, broadcasts in pairs]
        lines.append(
            f"| {numel:,} | {walls['all_gather']:.2f} | {walls['broadcasts']:.2f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{cpus['all_gather']:.2f} | {cpus['broadcasts']:.2f} |"
        )
    if rank == 0:
        text = "\n".join(lines)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as handle:
                handle.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
