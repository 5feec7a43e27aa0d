"""Stage 3's step against ``gather_coalesce_numel``, every setting in one process.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 -m tools.micro.coalesced_gathers \\
        --layers 4 --width 128 --limits 0,65536,262144,1048576 [--quantize-weights]

One engine per limit over the same GPT, batches and ranks; the engines take turns, a few
steps each, in alternating order, so the machine's drift falls on all of them alike.
Rank 0 prints each limit's median step and range over the timed rounds (the first round
records stage 3's prefetch order and is not timed). docs/across-nodes.md ("Coalesced
gathers") has what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zero_comm
import zero_core
from zero_models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=4, help="per rank and step")
    parser.add_argument("--limits", default="0,262144", help="gather_coalesce_numel values")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="per engine and round")
    parser.add_argument("--quantize-weights", action="store_true", help="qwZ")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = zero_comm.init()
    config = GPTConfig(
        context=args.context, layers=args.layers, heads=4, width=args.width, vocab_size=256
    )
    engines = {}
    for limit in (int(value) for value in args.limits.split(",")):
        model = GPT(config, seed=0)
        settings = zero_core.ZeroConfig(
            stage=3, gather_coalesce_numel=limit, quantize_weights=args.quantize_weights
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engines[limit] = zero_core.initialize(model, optimizer, settings, comm)
    generator = torch.Generator().manual_seed(comm.rank)
    tokens = torch.randint(0, 256, (args.sequences, args.context), generator=generator)
    times: dict[int, list[float]] = {limit: [] for limit in engines}
    for round_index in range(args.rounds):
        turn = list(engines.items())
        for limit, engine in turn if round_index % 2 == 0 else turn[::-1]:
            for _ in range(args.steps):
                comm.barrier()
                start = time.perf_counter()
                engine.backward(engine(tokens).float().mean())
                engine.step()
                if round_index > 0:
                    times[limit].append(time.perf_counter() - start)
    if comm.rank == 0:
        units = len(next(iter(engines.values())).compute_params.gatherer.units)
        for limit, seconds in times.items():
            ms = [s * 1000 for s in seconds]
            print(
                f"layers={args.layers} width={args.width} units={units} "
                f"qwZ={args.quantize_weights} gather_coalesce_numel={limit}: step median "
                f"{statistics.median(ms):.1f} ms [{min(ms):.1f}-{max(ms):.1f}]"
            )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
