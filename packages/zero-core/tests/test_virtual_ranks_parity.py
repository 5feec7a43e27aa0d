"""Virtual ranks are exact: N ranks with micro_batches_per_rank = counts hold, after every
step, the bits of the homogeneous run at V = sum(counts) ranks (issue 52).

Both runs are simulated worlds (parity.py's harness); virtual_parity.py feeds virtual rank
v the micro-batches rank v of the V-rank run trains on. Assertions are torch.equal on the
full float32 state after every applied step, on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParityCase, assert_same_states, build_engine, parity_cases, run_steps, train
from virtual_parity import run_virtual_steps, train_virtual, virtual_equals_homogeneous

import zero_core
from zero_comm import Communicator, run_simulated

COUNTS = [(2, 1), (1, 2), (1, 1, 2), (3, 1)]


@settings(max_examples=int(os.environ.get("VIRTUAL_PARITY_EXAMPLES", "30")), deadline=None)
@given(
    case=parity_cases(),
    counts=st.sampled_from(COUNTS),
    stage=st.sampled_from([0, 1, 2, 3]),
    accumulation=st.sampled_from([1, 2]),
    clip=st.sampled_from([None, 0.05]),
    dtype=st.sampled_from(["float32", "bfloat16", "float32", "bfloat16", "float16"]),
    weights=st.sampled_from([None, None, (3.0, 1.0, 2.0), (1.0, 2.5, 1.0)]),
)
def test_uneven_counts_equal_the_homogeneous_run_at_v_ranks(
    case: ParityCase,
    counts: tuple[int, ...],
    stage: int,
    accumulation: int,
    clip: float | None,
    dtype: str,
    weights: tuple[float, ...] | None,
) -> None:
    """``weights``: memory-weighted shards too (shard_weights, first len(counts) of them),
    which change no bit; the reference is the even V-rank run."""
    case = ParityCase(
        **{**case.__dict__, "accumulation": accumulation, "clip": clip, "dtype": dtype}
    )
    more = None if weights is None else {"shard_weights": weights[: len(counts)]}
    virtual_equals_homogeneous(case, stage, counts, more)


@pytest.mark.parametrize("counts", [(2, 2), (1, 1), (2, 1), (1, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stage_3_equals_the_homogeneous_run(counts: tuple[int, ...], dtype: str) -> None:
    """Equal counts gather per pass as usual; uneven ones pin the micro-step's units
    (param_gatherer), and both give the V-rank run's bits."""
    case = ParityCase(widths=(5, 33, 7), vocab=11, tie=True, dtype=dtype, accumulation=2,
                      clip=0.05, bucket_numel=64, persistence_threshold=20)  # fmt: skip
    virtual_equals_homogeneous(case, 3, counts)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_offloaded_optimizer_with_uneven_counts_equals_the_homogeneous_run(
    stage: int, tier: str
) -> None:
    """The tiers' reference is the homogeneous V-rank run without offload (stage 0); at
    stage 3 the parameters are offloaded to the same tier too."""
    case = ParityCase(widths=(5, 33, 7), dtype="bfloat16", accumulation=2, clip=0.05,
                      bucket_numel=300, sub_group_numel=64, offload_optimizer=tier,
                      offload_params=tier if stage == 3 else "none")  # fmt: skip
    plain = ParityCase(**{**case.__dict__, "offload_optimizer": "none", "offload_params": "none"})
    reference = run_simulated(3, lambda comm: train(plain, comm, 0))[0]
    got = run_simulated(2, lambda comm: train_virtual(case, comm, stage, (2, 1)))
    for rank, states in enumerate(got):
        assert_same_states(reference, states, f"{tier}, stage {stage}, rank {rank}")


def test_delayed_update_with_uneven_counts_equals_the_homogeneous_delayed_run() -> None:
    case = ParityCase(widths=(5, 33, 7), accumulation=2, bucket_numel=300,
                      offload_optimizer="cpu", steps=3)  # fmt: skip
    delayed = {"delayed_parameter_update": True}
    reference = run_simulated(3, lambda comm: train(case, comm, 2, settings=delayed))[0]
    got = run_simulated(2, lambda comm: train_virtual(case, comm, 2, (1, 2), delayed))
    for rank, states in enumerate(got):
        assert_same_states(reference, states, f"delayed update, rank {rank}")


@pytest.mark.parametrize(("save_counts", "load_counts"), [((2, 1), None), (None, (2, 1))])
def test_save_uneven_and_load_homogeneous_and_back(
    tmp_path: Any, save_counts: tuple[int, ...] | None, load_counts: tuple[int, ...] | None
) -> None:
    """Two steps at one layout, saved; two more at the other, loaded: equal to four steps
    of the homogeneous 3-rank run."""
    case = ParityCase(widths=(5, 33, 7), dtype="bfloat16", optimizer="adam", accumulation=2,
                      clip=0.05, bucket_numel=300, steps=4)  # fmt: skip
    reference = run_simulated(3, lambda comm: train(case, comm, 2))[0]

    def part(comm: Communicator, counts: tuple[int, ...] | None, steps: range) -> list[Any]:
        more = None if counts is None else {"micro_batches_per_rank": counts}
        engine = build_engine(case, comm, 2 if counts is None else 1, more)
        if steps.start:
            engine.load(tmp_path)
        run = run_steps if counts is None else run_virtual_steps
        states = run(engine, case, comm, steps)
        if not steps.start:
            engine.save(tmp_path)
        engine.close()
        return states

    def world(counts: tuple[int, ...] | None) -> int:
        return 3 if counts is None else len(counts)

    first = run_simulated(world(save_counts), lambda comm: part(comm, save_counts, range(2)))[0]
    second = run_simulated(world(load_counts), lambda comm: part(comm, load_counts, range(2, 4)))
    for rank, states in enumerate(second):
        assert_same_states(reference, first + states, f"resumed, rank {rank}")


def test_uneven_counts_really_change_the_bits() -> None:
    """The reference is not trivially met: the N-rank homogeneous run, or dividing by N
    instead of V, gives other bits (so the parity above can fail)."""
    case = ParityCase(widths=(5, 33, 7), accumulation=1, bucket_numel=64)
    reference = run_simulated(3, lambda comm: train(case, comm, 2))[0]
    two = run_simulated(2, lambda comm: train(case, comm, 2))[0]
    assert any(not torch.equal(a[k], b[k]) for a, b in zip(reference, two, strict=True) for k in a)


# ------------------------------------------------------------------- refusals, counting
@pytest.mark.parametrize(
    ("settings_", "named"),
    [
        ({"stage": 2, "shard_group_size": 1}, "shard_group_size=1"),
        ({"stage": 2, "quantize_gradients": True}, "quantize_gradients"),
        ({"stage": 3, "hpz_partition_size": 2, "micro_batches_per_rank": (2, 2)}, "hpz"),
        (
            {
                "stage": 3,
                "optimizer_in_backward": True,
                "nonfinite": "raise",
                "micro_batches_per_rank": (2, 2),
            },
            "optimizer_in_backward",
        ),
    ],
)
def test_what_is_not_supported_is_refused_by_name(settings_: dict, named: str) -> None:
    def body(comm: Communicator) -> None:
        config = zero_core.ZeroConfig(**{"micro_batches_per_rank": (2, 1), **settings_})
        with pytest.raises(ValueError, match=named):
            zero_core.initialize(torch.nn.Linear(4, 3), torch.optim.SGD, config, comm,
                                 optimizer_kwargs={"lr": 0.1})  # fmt: skip

    run_simulated(2, body)


def test_backward_counts_slots_and_step_applies_after_all_of_them() -> None:
    def body(comm: Communicator) -> list[bool]:
        config = zero_core.ZeroConfig(stage=2, micro_batches_per_rank=(2, 1))
        model = torch.nn.Linear(4, 3)
        engine = zero_core.initialize(model, torch.optim.SGD, config, comm,
                                      optimizer_kwargs={"lr": 0.1})  # fmt: skip
        applied = []
        for _ in range(engine.virtual_ranks.count):  # step() after every backward
            engine.backward(engine(torch.ones(2, 4)).sum())
            applied.append(engine.step())
        for _ in range(engine.virtual_ranks.count):  # or after the micro-step's slots
            engine.backward(engine(torch.ones(2, 4)).sum())
        if comm.rank == 0:
            with pytest.raises(RuntimeError, match="called 3 times without step"):
                engine.backward(engine(torch.ones(2, 4)).sum())
        applied.append(engine.step())
        return applied

    assert run_simulated(2, body) == [[False, True, True], [True, True]]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_report_counts_the_held_slot_copies(stage: int) -> None:
    """A rank with two slots holds one copy of its gradients (rank 0: its pre-added sum),
    a rank with one none; at stages 0 and 1 rank 0 adds its slots into the full buffers
    and holds nothing, so counts (2, 1) cost no memory there."""

    def body(comm: Communicator, counts: tuple[int, ...]) -> tuple[int, int]:
        case = ParityCase(widths=(5, 33, 7), bucket_numel=1 << 20)
        engine = build_engine(case, comm, stage, {"micro_batches_per_rank": counts})
        run_virtual_steps(engine, case, comm, range(1))
        report = engine.memory_report()
        numel = sum(p.numel() for p in engine.module.parameters())
        engine.close()
        return report.slot_copies, numel

    for counts in [(2, 1), (1, 2)]:
        reports = run_simulated(2, lambda comm, c=counts: body(comm, c))
        for rank, (held, numel) in enumerate(reports):
            if counts[rank] == 1 or (rank == 0 and stage < 2):
                assert held == 0
            else:  # one bucket of the parameters (padded to the ranks' alignment), float32
                assert numel * 4 <= held < numel * 4 + 2 * 128 * 4 * 2


def test_a_second_gradient_in_a_slot_added_in_place_is_refused() -> None:
    """Reentrant checkpointing gives a parameter two gradients in one backward. Where a
    hook lands each one as it comes (here: cast into a float32 buffer) rank 0 would add
    the first to its slots' sum before the second, which is not the fold: it raises.
    (Without hooks, autograd sums the two first and the whole gradient is added: exact.)"""
    from torch.utils.checkpoint import checkpoint

    def body(comm: Communicator) -> None:
        # overlap_comm=False: with overlap a second gradient after its chunk's (held)
        # launch is refused anyway (backward_overlap); (2, 2): slot 0 sends nothing.
        config = zero_core.ZeroConfig(
            stage=0, param_dtype="bf16", reduce_dtype="float32",
            micro_batches_per_rank=(2, 2), overlap_comm=False,
        )  # fmt: skip
        layer = torch.nn.Linear(4, 4).to(torch.bfloat16)
        engine = zero_core.initialize(layer, torch.optim.SGD, config, comm,
                                      optimizer_kwargs={"lr": 0.1})  # fmt: skip

        def twice(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(layer, checkpoint(layer, x, use_reentrant=True), use_reentrant=True)

        x = torch.ones(2, 4, dtype=torch.bfloat16, requires_grad=True)
        engine.backward(twice(x).float().sum())
        if comm.rank == 0:
            with pytest.raises(RuntimeError, match="use_reentrant=False"):
                engine.backward(twice(x).float().sum())

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [1, 2])
def test_two_to_one_moves_the_bytes_of_the_homogeneous_two_rank_run(stage: int) -> None:
    """Counts (2, 1): rank 0 pre-adds its two slots, so each rank sends one row and the
    gradient traffic equals two homogeneous ranks'; counts (1, 2) pad rank 0 to two rows
    (zero_comm.row_collectives), twice the reduce-scatter bytes."""
    case = ParityCase(widths=(5, 33, 7), bucket_numel=1 << 20, steps=1)

    def volume(comm: Communicator, counts: tuple[int, ...] | None) -> dict[str, float]:
        engine = build_engine(case, comm, stage, counts and {"micro_batches_per_rank": counts})
        comm.stats.reset()
        (run_steps if counts is None else run_virtual_steps)(engine, case, comm, range(1))
        engine.close()
        return {k: float(comm.stats[k].volume_bytes) for k in ("reduce_scatter", "all_gather")}

    plain = run_simulated(2, lambda comm: volume(comm, None))
    assert run_simulated(2, lambda comm: volume(comm, (2, 1))) == plain
    padded = run_simulated(2, lambda comm: volume(comm, (1, 2)))
    for mine, theirs in zip(padded, plain, strict=True):
        assert mine["reduce_scatter"] == 2 * theirs["reduce_scatter"]
        assert mine["all_gather"] == theirs["all_gather"]
