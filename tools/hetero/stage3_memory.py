"""What stage 3 with uneven micro-batch counts costs in device memory (issue 52).

    python -m tools.hetero.stage3_memory [--model small] [--dtype float32]

With uneven counts the first forward of each micro-step gathers every parameter and keeps
them until the rank's last backward (zero_core.param_gatherer, ``pin_slots``): every rank
issues the same gathers whatever its slot count. This prints each rank's
``memory_report()`` (MiB) at the moment that holds the most: just after the first slot's
backward (the pinned parameters and the held gradient copy), for counts 2,1 against equal
counts 1,1 (the usual stage 3, which frees each unit after use), two simulated ranks,
zero-train's GPT preset.
"""

from __future__ import annotations

import argparse
from typing import Any

MIB = 1 << 20


def measure(model: str, dtype: str, counts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each rank's report after the first backward of a micro-step (the second step's, so
    that lazily made buffers exist) and after that step."""
    import torch

    import zero_core
    from zero_comm import Communicator, run_simulated
    from zero_models.gpt import GPT, PRESETS

    config = PRESETS[model]

    def body(comm: Communicator) -> dict[str, Any]:
        torch.manual_seed(0)
        module = GPT(config, seed=0)
        engine = zero_core.initialize(
            module,
            lambda params: torch.optim.AdamW(params, lr=1e-4),
            zero_core.ZeroConfig(
                stage=3, micro_batches_per_rank=counts, param_dtype=getattr(torch, dtype)
            ),
            comm,
        )
        generator = torch.Generator().manual_seed(comm.rank)
        reports: dict[str, Any] = {}
        for step in range(2):
            for slot in range(counts[comm.rank]):
                tokens = torch.randint(
                    0, config.vocab_size, (1, config.context + 1), generator=generator
                )
                logits = engine(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, config.vocab_size).float(), tokens[:, 1:].reshape(-1)
                )
                engine.backward(loss)
                if step == 1 and slot == 0:
                    reports["after_first_backward"] = engine.memory_report()._asdict()
            engine.step()
        reports["after_step"] = engine.memory_report()._asdict()
        reports["numel"] = sum(p.numel() for p in module.parameters())
        engine.close()
        return reports

    return run_simulated(len(counts), body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    print(f"GPT {args.model}, stage 3, {args.dtype}, 2 simulated ranks; MiB")
    print("counts  rank  moment                parameters  gradients  slot_copies  total")
    for counts in [(1, 1), (2, 1), (1, 2)]:
        for rank, reports in enumerate(measure(args.model, args.dtype, counts)):
            for moment in ("after_first_backward", "after_step"):
                r = reports[moment]
                total = r["parameters"] + r["gradients"] + r["master_weights"]
                total += r["optimizer_states"] + r["buffers"] + r["comm_buffers"]
                total += r["slot_copies"]
                print(
                    f"{','.join(map(str, counts)):7} {rank:4}  {moment:20}  "
                    f"{r['parameters'] / MIB:10.2f}  {r['gradients'] / MIB:9.2f}  "
                    f"{r['slot_copies'] / MIB:11.2f}  {total / MIB:5.2f}"
                )
        print(f"(parameters: {reports['numel']:,})")


if __name__ == "__main__":
    main()
