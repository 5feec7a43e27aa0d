#!/usr/bin/env python
"""Save and load time of a sharded checkpoint, and the peak memory of consolidating it.

    zero-launch -n 2 python -m tools.micro.checkpoint --model gpt2-medium --out /tmp/ckpt
    zero-launch -n 2 python -m tools.micro.checkpoint --model gpt2-xl --no-step --out /tmp/ckpt

Every rank builds the GPT preset on the meta device at stage 3 (bfloat16 compute, float32
masters, AdamW), takes one training step on one short sequence (so the checkpoint holds
Adam's states; ``--no-step`` skips it and saves masters only, for presets whose Adam
states do not fit), then times ``engine.save`` and ``engine.load`` (median of
``--repeat``; the load goes into the same engine). Rank 0 then runs ``zero-consolidate``
in a child process and reports that process's peak resident memory (VmHWM) next to the
model's float32 size and its largest tensor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import zero_comm
import zero_core
from zero_models.gpt import GPT, PRESETS

MIB = 2**20


def folder_bytes(path: Path) -> int:
    """Bytes of the checkpoint saved at ``path`` (the one ``path/latest`` names)."""
    found = zero_core.complete_checkpoint(path)
    assert found is not None, f"no checkpoint at {path}"
    return sum(f.stat().st_size for f in found.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-step", action="store_true", help="save masters only")
    parser.add_argument("--json", type=Path, help="where rank 0 writes the results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = zero_comm.init("gloo", deterministic=True, timeout=1800)
    config = PRESETS[args.model]
    with torch.device("meta"):
        model = GPT(config)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        zero_core.ZeroConfig(stage=3, param_dtype=torch.bfloat16),
        comm,
        init_values=model.initial_values(0),
    )
    if not args.no_step:
        tokens = torch.randint(
            0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)
        )
        logits = engine(tokens)
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), tokens.roll(1, 1).view(-1)
        )
        engine.backward(loss)
        engine.step()
    saves, loads = [], []
    for _ in range(args.repeat):
        comm.barrier()
        t0 = time.perf_counter()
        engine.save(args.out, extra={"model": args.model})
        saves.append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        engine.load(args.out)
        loads.append(time.perf_counter() - t0)
    psi = sum(p.numel() for _, p in engine.trainable_parameters())
    largest = max(p.numel() for _, p in engine.trainable_parameters())
    if comm.rank == 0:
        out = args.out.with_suffix(".safetensors")
        # The child reports its own peak (VmHWM): ru_maxrss of children would count the
        # pages of this large process that the child shares between fork and exec.
        probe = (
            "import sys; from zero_core.checkpoint.consolidate import main; main(sys.argv[1:]); "
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
        )
        command = [sys.executable, "-c", probe, str(args.out), str(out)]
        t0 = time.perf_counter()
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        consolidate_s = time.perf_counter() - t0
        peak = int(done.stdout.split("VmHWM:")[1].split()[0]) * 1024
        result = {
            "model": args.model,
            "parameters": psi,
            "world_size": comm.world_size,
            "optimizer_states": not args.no_step,
            "checkpoint_mib": folder_bytes(args.out) / MIB,
            "save_s_median": statistics.median(saves),
            "load_s_median": statistics.median(loads),
            "save_s": saves,
            "load_s": loads,
            "consolidate_s": consolidate_s,
            "consolidate_peak_rss_mib": peak / MIB,
            "model_fp32_mib": psi * 4 / MIB,
            "largest_tensor_fp32_mib": largest * 4 / MIB,
            "consolidated_mib": out.stat().st_size / MIB,
        }
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        out.unlink()
    comm.close()


if __name__ == "__main__":
    main()
