"""The engine on one CUDA GPU (nccl, world size 1), run by test_cuda_engine.py in its own
process so that its process group never meets the rest of the suite's.

Checks, each an assertion:
  - stages 1-3 equal stage 0 bit for bit after every step (bf16, accumulation, clipping,
    tied embedding, every parameter partitioned at stage 3);
  - stage 3 with optimizer states and parameters in host memory trains (finite, and within
    1e-2 of stage 0: its AdamW runs on the CPU, whose rounding the GPU's need not share);
  - a checkpoint saved after two steps, loaded into a new engine, continues bit for bit as
    the engine that saved it does (its optimizer state lands on the GPU, not the host);
  - ZeRO++'s codec sends the same bytes from the GPU as from the CPU, and decodes them to
    the same bits (so qwZ and qgZ on NCCL equal gloo's).
"""

from __future__ import annotations

import sys
import tempfile

import torch
from parity import ParityCase, assert_same_states, build_engine, normalised, run_steps

import zero_comm
from zero_comm.block_quantize import BlockQuantizer

CASE = ParityCase(
    vocab=11,
    tie=True,
    dtype="bfloat16",
    clip=0.5,
    accumulation=2,
    bucket_numel=64,
    persistence_threshold=0,
    steps=3,
)


def codec_matches_the_cpu() -> None:
    """Encode on the GPU and on the CPU: the same wire bytes; decode both ways: the same
    bits (values spread over 2^-12..2^8, a zero block, a NaN and an infinity)."""
    generator = torch.Generator().manual_seed(0)
    for bits, block in ((8, 2048), (4, 128), (4, 6), (8, 5)):
        quantizer = BlockQuantizer(bits, block)
        for dtype in (torch.float32, torch.bfloat16):
            for parts, numel in ((1, 10_000), (4, 40_001 if bits == 8 else 40_002)):
                x = torch.randn(parts * numel, generator=generator, dtype=torch.float64)
                x *= 2.0 ** torch.randint(-12, 9, x.shape, generator=generator).double()
                x[:block] = 0
                x[-(3 * block + 1)], x[-1] = float("nan"), float("inf")
                x = x.to(dtype)
                wire = quantizer.encode(x, parts=parts)
                assert torch.equal(quantizer.encode(x.cuda(), parts=parts).cpu(), wire), (
                    f"int{bits} block {block} {dtype}: the GPU sent other bytes"
                )
                here = quantizer.decode(wire, numel, parts=parts)
                there = quantizer.decode(wire.cuda(), numel, parts=parts).cpu()
                same = here.view(torch.int32) == there.view(torch.int32)
                assert bool((same | (here.isnan() & there.isnan())).all()), (
                    f"int{bits} block {block} {dtype}: the GPU decoded other bits"
                )
    print("ZeRO++'s codec: the same bytes and bits on the GPU as on the CPU")


def main() -> int:
    codec_matches_the_cpu()
    comm = zero_comm.init("nccl", deterministic=True)
    assert comm.device.type == "cuda", comm.device
    case = normalised(CASE)
    reference = run_steps(build_engine(case, comm, 0), case, comm, range(case.steps))
    for stage in (1, 2, 3):
        assert_same_states(
            reference,
            run_steps(build_engine(case, comm, stage), case, comm, range(case.steps)),
            f"cuda stage {stage}",
        )
        print(f"stage {stage} == stage 0 bit for bit on {torch.cuda.get_device_name()}")
    offloaded = ParityCase(**{**case.__dict__, "offload_optimizer": "cpu", "offload_params": "cpu"})
    states = run_steps(build_engine(offloaded, comm, 3), offloaded, comm, range(case.steps))
    for key, value in states[-1].items():
        assert torch.isfinite(value).all(), key
        assert torch.allclose(value, reference[-1][key], atol=1e-2), key
    print("stage 3 with host offload trains within 1e-2 of stage 0")
    with tempfile.TemporaryDirectory() as folder:
        for stage in (0, 3):
            saver = build_engine(case, comm, stage)
            run_steps(saver, case, comm, range(2))
            saver.save(folder)
            uninterrupted = run_steps(saver, case, comm, range(2, case.steps))
            resumed = build_engine(case, comm, stage)
            resumed.load(folder)
            assert_same_states(
                uninterrupted,
                run_steps(resumed, case, comm, range(2, case.steps)),
                f"cuda stage {stage} resumed",
            )
            print(f"stage {stage}: a loaded checkpoint continues bit for bit")
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
