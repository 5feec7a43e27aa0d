"""Measured memory and communication against the paper's formulas.

Mixed-precision Adam (bf16 compute, K = 12: fp32 master 4 + two fp32 moments 8). Ψ counts
elements including the stated padding: each parameter starts at a multiple of BLOCK and each
bucket is padded to N x BLOCK, so P (a full replica's elements) >= Ψ and P - Ψ is bounded
by (#parameters + N x #buckets) x BLOCK. Adam also keeps one float32 step counter per tensor
it steps: one per group at stage 0, one per bucket slice at stages 1-3.

With ``reduce_dtype=float32`` the gradient term is 4 bytes per element instead of 2 (the
buffers and shards are float32) and so are the gradient collectives' bytes; parameters and
their gathers stay bf16.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from parity import ParityCase, build_engine, loss_of, micro_batch

from zero_comm import Communicator, run_simulated
from zero_core import MemoryReport, ZeroEngine, model_state_bytes
from zero_core.grad_norm import BLOCK
from zero_core.replicated_params import ReplicatedParameters

State = dict[str, torch.Tensor]
CASE = ParityCase(widths=(37, 300, 129, 5), dtype="bfloat16", optimizer="adam", two_groups=True,
                  bucket_numel=20_000, persistence_threshold=0)  # fmt: skip


# Gradient bytes per element: bf16 (reduce_dtype None, the default) or float32.
GRADIENT_WIDTHS = {None: 2, "float32": 4}


def one_step_then_backward(
    comm: Communicator, stage: int, reduce_dtype: str | None = None
) -> tuple[object, dict, dict]:  # type: ignore[type-arg]
    engine = build_engine(
        ParityCase(**{**CASE.__dict__, "reduce_dtype": reduce_dtype}), comm, stage
    )
    comm.stats.reset()
    x, t = micro_batch(CASE, comm.rank)
    engine.backward(loss_of(CASE, engine(x.to(torch.bfloat16)), t))
    engine.step()
    counts = comm.stats.as_dict().items()
    traffic = {name: c["volume_elements"] for name, c in counts}
    traffic.update({f"{name} bytes": c["volume_bytes"] for name, c in counts})
    engine.backward(loss_of(CASE, engine(x.to(torch.bfloat16)), t))
    sizes = {"psi": sum(p.numel() for _, p in engine.trainable_parameters()),
             "pieces": sum(len(tiles) for tiles in engine.masters.tiles)}  # fmt: skip
    if engine.policy.shard_optimizer_states:
        sizes["padded"] = sum(layout.padded_numel for layout in engine.layouts)
        sizes["shard"] = sum(layout.shard_numel for layout in engine.layouts)
        sizes["buckets"] = sum(len(layout.buckets) for layout in engine.layouts)
    return engine.memory_report(), traffic, sizes


@pytest.mark.parametrize("reduce_dtype", [None, "float32"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_equals_the_paper(stage: int, n: int, reduce_dtype: str | None) -> None:
    report, _, s = run_simulated(n, lambda comm: one_step_then_backward(comm, stage, reduce_dtype))[
        0
    ]
    psi, step_counters = s["psi"], 4 * s["pieces"]  # one per tensor the optimizer steps
    g = GRADIENT_WIDTHS[reduce_dtype]
    if stage == 0:
        expected = (2 * psi, g * psi, 4 * psi, 8 * psi + step_counters)
    else:
        padded, shard = s["padded"], s["shard"]
        assert shard * n == padded
        assert psi <= padded < psi + (len(CASE.widths) * 2 + n * s["buckets"]) * BLOCK
        grads = g * padded if stage == 1 else g * shard
        params = 2 * shard if stage == 3 else 2 * padded  # stage 3: after backward, all freed
        expected = (params, grads, 4 * shard, 8 * shard + step_counters)
    measured = (report.parameters, report.gradients, report.master_weights,
                report.optimizer_states)  # fmt: skip
    assert measured == expected


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_float32_parameters_are_the_master_weights_at_every_stage(stage: int, n: int) -> None:
    """Float32 training keeps one float32 copy of each parameter: the optimizer steps the
    parameters (stage 0), this rank's slice of each parameter bucket (stages 1 and 2; the
    all-gather after the step sends it to the others) or the compute shard (stage 3)
    themselves, as DDP and FSDP2 do; no separate master (4Ψ, or 4Ψ/N, more before). So the
    model states are the paper's formula with 4-byte parameters and gradients and K = 8
    (Adam's moments), exactly: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N, with Ψ counting the
    padding at stages 1-3 (a replica's elements). Buckets of 5000 elements: several per
    group, and a parameter larger than a bucket (published in pieces). Two steps equal
    stage 0 bit for bit, parameters included, and the buckets' padding stays zero."""
    case = ParityCase(widths=(37, 300, 129, 5), dtype="float32", optimizer="adam",
                      two_groups=True, bucket_numel=5000, persistence_threshold=0)  # fmt: skip

    def train_two_steps(comm: Communicator, stage: int) -> tuple[ZeroEngine, list[State], State]:
        engine = build_engine(case, comm, stage)
        states = []
        for step in range(2):
            x, t = micro_batch(case, step * comm.world_size + comm.rank)
            engine.backward(loss_of(case, engine(x), t))
            engine.step()
            states.append(engine.full_state_dict())
        params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        return engine, states, params

    def body(comm: Communicator) -> tuple[MemoryReport, int, int]:
        engine, states, params = train_two_steps(comm, stage)
        _, reference, reference_params = train_two_steps(comm, 0)
        assert all(
            torch.equal(a[k], b[k]) for a, b in zip(states, reference, strict=True) for k in a
        )
        if stage != 3:  # stage 3's parameters are placeholders between uses
            assert all(torch.equal(params[k], reference_params[k]) for k in params)
        pieces = [tile for tiles in engine.masters.tiles for tile, _ in tiles]
        held = (
            engine.compute_params.store.shards if hasattr(engine.compute_params, "store") else None
        ) or list(engine.module.parameters())
        assert {p.untyped_storage().data_ptr() for p in pieces} <= {
            h.untyped_storage().data_ptr() for h in held
        }, "the optimizer steps a tensor that is not the parameters' storage"
        if stage in (1, 2):
            assert isinstance(engine.compute_params, ReplicatedParameters)
            groups = engine.compute_params.buckets.groups
            for layout, group in zip(engine.layouts, groups, strict=True):
                padding = [bucket.full_buffer.clone() for bucket in group]
                for k, flat in layout.param_places():
                    padding[k][flat.start : flat.stop] = 0.0
                assert all(not pad.any() for pad in padding), "padding is not zero"
        elements = sum(p.numel() for p in pieces)
        steps = 4 * len(pieces)  # Adam's step counter, one per tensor it steps
        return engine.memory_report(), elements, steps

    report, elements, steps = run_simulated(n, body)[0]
    replica = elements if stage == 0 else n * elements  # Ψ, or P with the padding
    formula = model_state_bytes(
        replica, n, stage, optimizer_state_bytes=8, param_bytes=4, grad_bytes=4
    )
    assert report.master_weights == 0
    assert report.optimizer_states == 8 * elements + steps
    assert report.model_states == formula.total + steps
    assert report.parameters == formula.parameters


@pytest.mark.parametrize("reduce_dtype", [None, "float32"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_step_moves_what_the_paper_says(stage: int, n: int, reduce_dtype: str | None) -> None:
    """Stage 0: all-reduce 2Ψ(N-1)/N. Stages 1, 2: reduce-scatter + all-gather of the
    (padded) Ψ, (N-1)/N each; stage 3: all-gather in forward and again in backward, so
    3Ψ(N-1)/N in all. Stages 1-3 add one all-reduce of a single element: whether any
    rank's gradient shard holds a NaN or Inf (stage 0 ranks all hold the whole gradient
    and need no message for that). Volumes in elements, exact; bytes at the gradient's
    width for the reductions (g: 2, or 4 with reduce_dtype=float32), bf16's for gathers."""
    _, traffic, s = run_simulated(
        n, lambda comm: one_step_then_backward(comm, stage, reduce_dtype)
    )[0]
    g = GRADIENT_WIDTHS[reduce_dtype]
    if stage == 0:
        assert traffic["all_reduce"] == float(Fraction(2 * (n - 1) * s["psi"], n))
        assert traffic["all_reduce bytes"] == g * traffic["all_reduce"]
        assert traffic["reduce_scatter"] == traffic["all_gather"] == 0
    else:
        assert traffic["all_reduce"] == float(Fraction(2 * (n - 1), n))
        assert traffic["all_reduce bytes"] == 4 * traffic["all_reduce"]  # an int32 flag
        assert traffic["reduce_scatter"] == float(Fraction((n - 1) * s["padded"], n))
        assert traffic["reduce_scatter bytes"] == g * traffic["reduce_scatter"]
        gathers = 2 if stage == 3 else 1
        assert traffic["all_gather"] == float(Fraction(gathers * (n - 1) * s["padded"], n))
        assert traffic["all_gather bytes"] == 2 * traffic["all_gather"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("hidden", [64, 2048], ids=["params-fit-a-bucket", "oversized-param"])
def test_communication_buffers_are_bounded_by_config_not_model(stage: int, hidden: int) -> None:
    """C_B: staging buffers come from the communicator's pool: at most
    max_buckets_in_flight + 1 pieces of bucket_numel (each at most 1/8 over), for a small
    and a 10x model, also when one parameter is larger than bucket_numel (16 x 2048 and
    16 x 20480 elements against 16384: reduced and gathered in pieces, never staged whole).
    Both models stay within the one bound, which is the configuration's, not the model's."""
    held = []
    for scale in (1, 10):
        case = ParityCase(widths=(16, hidden * scale, 16), dtype="bfloat16", bucket_numel=16384)

        def body(comm: Communicator, case: ParityCase = case) -> int:
            engine = build_engine(case, comm, stage)
            # The most the pool held at any take (stage 3 empties it after backward).
            peak, take = [0], comm.buffers.take

            def take_and_watch(numel: int, dtype: torch.dtype) -> torch.Tensor:
                buffer = take(numel, dtype)
                peak[0] = max(peak[0], comm.buffers.bytes_held)
                return buffer

            comm.buffers.take = take_and_watch  # type: ignore[method-assign]
            for _ in range(2):
                x, t = micro_batch(case, comm.rank)
                engine.backward(loss_of(case, engine(x.to(torch.bfloat16)), t))
                engine.step()
            return peak[0]

        held.append(run_simulated(2, body)[0])
    bound = (2 + 1) * 2 * 2 * 16384 * 2  # buckets x rounding x (staging + out) x bytes
    assert all(0 < h <= bound for h in held), held
