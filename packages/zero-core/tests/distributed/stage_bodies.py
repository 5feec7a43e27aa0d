"""Bodies run on every rank of a real world: the stage parity suite over gloo and MPI."""

from __future__ import annotations

import sys
from pathlib import Path

from zero_comm import Communicator
from zero_comm.testing.properties import run_property_in_step
from zero_core.component_access import sharded_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # parity.py lives one level up
from parity import offloaded_parity_cases, parity_cases, stages_equal_stage0, tiers_equal_stage0


def parity_suite(comm: Communicator, examples: int) -> int:
    """The stage parity property on real ranks: every rank draws the same cases."""
    return run_property_in_step(
        comm, parity_cases(), lambda case: stages_equal_stage0(comm, case), examples
    )


def offload_parity_suite(comm: Communicator, examples: int) -> int:
    """Every offload tier equals stage 0 without offload, on real ranks."""
    return run_property_in_step(
        comm, offloaded_parity_cases(), lambda case: tiers_equal_stage0(comm, case), examples
    )


def _rss_kib(field: str) -> int:
    from zero_core.memory.proc_status import process_status_kib

    found = process_status_kib(field)
    if found is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return found


def peak_memory_of_a_step(comm: Communicator, layers: int, width: int) -> dict[str, int]:
    """Bytes: resident memory before the model existed, the peak during one training step
    (VmHWM, reset just before it), and what the engine says it holds.

    The model is built on the meta device and its values streamed in (init_values), so a
    stage 3 rank never holds it whole."""
    import torch
    from torch import nn

    import zero_core

    generator = torch.Generator().manual_seed(0)
    small = nn.Linear(4, 4)  # load every code path once, so that "before" includes it
    warm = zero_core.initialize(small, torch.optim.Adam(small.parameters()),
                                zero_core.ZeroConfig(stage=3), comm)  # fmt: skip
    warm.backward(warm(torch.ones(1, 4)).sum())
    warm.step()
    before = _rss_kib("VmRSS") * 1024
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    values = (
        (name, torch.randn(p.shape, generator=generator) * 0.02)
        for name, p in model.named_parameters()
    )
    engine = zero_core.initialize(
        model, torch.optim.Adam(model.parameters(), lr=1e-3),
        # Nothing gathered ahead, and nothing kept from forward but backward's first layer.
        zero_core.ZeroConfig(
            stage=3, persistence_threshold=0, prefetch_numel=0, backward_head_numel=0
        ),
        comm,
        init_values=values,
    )  # fmt: skip
    built = _rss_kib("VmHWM") * 1024  # the peak so far: set-up included
    x = torch.randn(8, width, generator=generator)
    for _ in range(2):  # the first step creates the optimizer states
        engine.backward(engine(x).square().mean())
        engine.step()
    ready = _rss_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    engine.backward(engine(x).square().mean())
    held = engine.memory_report()  # gradient shards are held from backward to step only
    engine.step()
    peak = _rss_kib("VmHWM") * 1024
    report = engine.memory_report()
    return {
        "before": before,
        "peak": peak,
        "built": built,
        "ready": ready,
        "largest_bucket": 4
        * max(
            b.layout.padded_numel
            for layout in engine.layouts  # type: ignore[attr-defined]
            for b in layout.buckets
        ),
        "bucket_numel": engine.config.bucket_numel,
        # (2 + 2 + K)Ψ/N: shards only, whatever happens to be gathered right now
        "model_states": sum(shard.numel() * 4 for shard in sharded_parameters(engine).store.shards)
        + held.gradients
        + report.master_weights
        + report.optimizer_states,
        "optimizer_states": report.optimizer_states,
        "comm_buffers": report.comm_buffers,
        "working_set": sharded_parameters(engine).gatherer.peak_live_numel * 4,
        "whole_model": sum(p.numel() for p in model.parameters()) * 4,
    }


def resume_is_exact(comm: Communicator, folder: str) -> int:
    """At every stage: save after 2 steps, continue 2; a fresh engine loads the file and
    continues 2: the same parameters and losses, bit for bit. Returns the stages run."""
    import torch
    from parity import build_engine, normalised
    from test_checkpoint import CASE, run_steps

    case = normalised(CASE)
    for stage in (0, 1, 2, 3):
        path = Path(folder) / f"stage{stage}"
        straight = build_engine(case, comm, stage)
        run_steps(straight, case, comm, 0, 2)
        straight.save(path)
        losses = run_steps(straight, case, comm, 2, 2)
        resumed = build_engine(case, comm, stage)
        resumed.load(path)
        assert run_steps(resumed, case, comm, 2, 2) == losses, stage
        a, b = straight.full_state_dict(), resumed.full_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), stage
    return 4


def virtual_ranks_are_exact(comm: Communicator, counts: list[int]) -> int:
    """Real ranks with micro_batches_per_rank=counts at stages 0-3 equal the homogeneous
    run at V = sum(counts) ranks, computed here on a simulated world of V ranks (the same
    process: the same fingerprint). Returns the number of stages checked."""
    from parity import ParityCase, assert_same_states, train
    from virtual_parity import train_virtual

    from zero_comm import run_simulated

    case = ParityCase(widths=(5, 33, 7), vocab=11, tie=True, dtype="bfloat16",
                      accumulation=2, clip=0.05, bucket_numel=300, steps=2)  # fmt: skip
    checked = 0
    for stage in (0, 1, 2, 3):
        got = train_virtual(case, comm, stage, tuple(counts))
        reference = run_simulated(sum(counts), lambda world, s=stage: train(case, world, s))[0]
        assert_same_states(reference, got, f"stage {stage}, counts {counts}, rank {comm.rank}")
        checked += 1
    return checked
