"""Stage 3 with the optimizer step fused into backward (ZeroConfig.optimizer_in_backward).

The property: the same bits as stage 0 (and so as plain stage 3) after every step, for
every world size, precision (float32, bfloat16), optimizer, bucketing, tying, freezing and
grouping the parity suite draws; and no rank ever holds more than one bucket slice of its
gradient shard. The settings it cannot honour are refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    assert_same_states,
    build_engine,
    loss_of,
    micro_batch,
    normalised,
    parity_cases,
    train,
)

from zero_comm import Communicator, run_simulated
from zero_core import ZeroConfig

FUSED = {"optimizer_in_backward": True, "nonfinite": "raise"}


def fusable(case: ParityCase) -> ParityCase:
    """``case`` without what the fused step refuses (float16, accumulation, clipping)."""
    dtype = "float32" if case.dtype == "float16" else case.dtype
    return ParityCase(**{**case.__dict__, "dtype": dtype, "accumulation": 1, "clip": None})


@settings(max_examples=40, deadline=None)
@given(
    case=parity_cases(),
    world_size=st.sampled_from([3, 3, 1, 2, 4]),
    deferred=st.booleans(),
    steps=st.sampled_from([1, 3]),
)
def test_the_fused_step_equals_stage_0_bit_for_bit(
    case: ParityCase, world_size: int, deferred: bool, steps: int
) -> None:
    case = ParityCase(**{**fusable(case).__dict__, "steps": steps})

    def body(comm: Communicator) -> None:
        reference = train(case, comm, 0)
        assert_same_states(reference, train(case, comm, 3, settings=FUSED), "fused stage 3")

    run_simulated(world_size, body, defer_outputs=deferred)


@pytest.mark.parametrize(
    ("extra", "persistence"),
    [({"shard_group_size": 2}, 0), ({"hpz_partition_size": 2}, 0), ({}, 200)],
    ids=["hybrid-2x2", "hpz-2", "persistent-unit"],
)
def test_the_fused_step_composes_with_hybrid_sharding_and_hpz(
    extra: dict[str, Any], persistence: int
) -> None:
    case = ParityCase(
        widths=(33, 130, 7), vocab=11, tie=True, bucket_numel=300, steps=3, seed=4,
        persistence_threshold=persistence,
    )  # fmt: skip

    def body(comm: Communicator) -> None:
        reference = train(case, comm, 0)
        fused = train(case, comm, 3, settings={**FUSED, **extra})
        assert_same_states(reference, fused, f"fused stage 3 with {extra}")

    run_simulated(4, body)


def held_gradient_bytes(case: ParityCase, fused: bool) -> tuple[int, int, int]:
    """(most gradient-shard bytes with storage at any bucket's landing, the widest bucket
    slice's bytes, the whole shard's bytes) on rank 0 of 2, over 2 steps."""

    def body(comm: Communicator) -> tuple[int, int, int]:
        engine = build_engine(case, comm, 3, FUSED if fused else {"nonfinite": "raise"})
        shards = engine.gradients.grad_shards
        reducer = engine.gradients.reducer
        stepper = reducer.on_reduced
        most = 0

        def sample(index: int) -> None:
            nonlocal most
            most = max(most, sum(shard.held_bytes() for shard in shards))
            if stepper is not None:
                stepper(index)

        reducer.on_reduced = sample
        for step in range(2):
            x, target = micro_batch(case, step * comm.world_size + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            assert engine.step()
        pieces = [p for shard in shards for p in shard.pieces]
        widest = max(p.numel() * p.element_size() for p in pieces)
        whole = sum(shard.nbytes() for shard in shards)
        engine.close()
        return most, widest, whole

    return run_simulated(2, body)[0]


def test_no_rank_holds_more_than_one_bucket_slice_of_its_gradient_shard() -> None:
    """Fused: at most one slice has storage when a bucket lands. The control (plain stage
    3, sampled the same way) holds the whole shard by the last bucket, so the sampling
    sees what it is meant to."""
    case = normalised(ParityCase(widths=(32,) * 9, bucket_numel=2048, seed=2))
    most, widest, whole = held_gradient_bytes(case, fused=True)
    assert whole > 4 * widest, "the case needs several buckets"
    assert most <= widest, f"held {most} bytes of gradient at once; one slice is {widest}"
    plain_most, _, plain_whole = held_gradient_bytes(case, fused=False)
    assert plain_most == plain_whole == whole


def test_the_memory_report_counts_one_bucket_slice_of_gradients() -> None:
    case = ParityCase(widths=(32,) * 9, bucket_numel=2048, seed=2)

    def body(comm: Communicator) -> tuple[int, int]:
        fused = build_engine(case, comm, 3, FUSED).memory_report()
        plain = build_engine(case, comm, 3, {"nonfinite": "raise"}).memory_report()
        return fused.gradients, plain.gradients

    fused, plain = run_simulated(2, body)[0]
    assert 0 < fused <= 2048 // 2 * 4 < plain


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"stage": 2}, "stage=2 (it needs stage 3)"),
        ({"clip_grad_norm": 1.0}, "clip_grad_norm=1.0"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"param_dtype": "fp16"}, "param_dtype=float16"),
        ({"offload_optimizer": "cpu"}, "offloaded model states"),
        ({"nonfinite": "skip"}, "set nonfinite='raise'"),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(
    settings: dict[str, Any], named: str
) -> None:
    chosen = {"stage": 3, **FUSED, **settings}
    with pytest.raises(ValueError, match="optimizer_in_backward") as raised:
        ZeroConfig(**chosen)
    assert named in str(raised.value)
    assert "optimizer_in_backward=False" in str(raised.value)


def test_an_optimizer_that_may_read_every_tensor_is_refused() -> None:
    class GlobalAdam(torch.optim.Adam):  # a subclass may override step()
        pass

    def body(comm: Communicator) -> str:
        model = torch.nn.Linear(4, 4)
        config = ZeroConfig(stage=3, allow_untested_optimizer=True, **FUSED)
        import zero_core

        with pytest.raises(ValueError, match="one bucket at a time") as raised:
            zero_core.initialize(model, GlobalAdam(model.parameters()), config, comm)
        return str(raised.value)

    assert "GlobalAdam" in run_simulated(1, body)[0]


def test_a_non_finite_gradient_raises_on_every_rank_and_names_the_rank() -> None:
    """Rank 1's input is NaN: its gradients, and so every reduced sum, are NaN; every rank
    raises after backward, naming the ranks whose slices hold it (here rank 0 only: these
    parameters fit in rank 0's padded slices) and the bucket's parameters, on every rank."""
    case = ParityCase(widths=(5, 7, 3), bucket_numel=64, seed=1)

    def body(comm: Communicator) -> str:
        engine = build_engine(case, comm, 3, FUSED)
        x, _ = micro_batch(case, comm.rank)
        if comm.rank == 1:
            x = torch.full_like(x, float("nan"))
        with pytest.raises(FloatingPointError) as raised:
            engine.backward(loss_of(case, engine(x), torch.zeros(0)))
        assert not engine.step(), "a backward that raised applies nothing more in step()"
        engine.close()
        return str(raised.value)

    messages = run_simulated(2, body)
    for rank, message in enumerate(messages):
        saw = "non-finite gradient at step 0 in the reduced gradient slices held by "
        assert f"[rank {rank}] {saw}data-parallel rank(s) [0]" in message
        assert "whose parameters are layers." in message
        assert "restore the last checkpoint" in message


@pytest.mark.parametrize(
    "lossy", [{"quantize_weights": True}, {"quantize_gradients": "int8"}], ids=["qwZ", "qgZ"]
)
def test_with_zeropp_quantization_the_fused_step_equals_plain_stage_3(
    lossy: dict[str, Any],
) -> None:
    """qwZ and qgZ are lossy, so stage 0 is no reference; plain stage 3 with the same
    quantization is, bit for bit (the quantization is deterministic)."""
    case = ParityCase(widths=(33, 130, 7), vocab=11, bucket_numel=300, steps=3, seed=6)

    def body(comm: Communicator) -> None:
        plain = train(case, comm, 3, settings={"nonfinite": "raise", **lossy})
        fused = train(case, comm, 3, settings={**FUSED, **lossy})
        assert_same_states(plain, fused, f"fused stage 3 with {lossy}")

    run_simulated(4, body)


def test_the_update_is_whole_after_backward_and_step_only_counts_it() -> None:
    """backward publishes (the persistent unit too): the state after backward is the
    state after step(), and equals plain stage 3's after its step()."""
    case = ParityCase(widths=(33, 130, 7), vocab=11, bucket_numel=300, persistence_threshold=200)

    def body(comm: Communicator) -> None:
        x, target = micro_batch(case, comm.rank)
        plain = build_engine(case, comm, 3, {"nonfinite": "raise"})
        plain.backward(loss_of(case, plain(x), target))
        assert plain.step()
        fused = build_engine(case, comm, 3, FUSED)
        fused.backward(loss_of(case, fused(x), target))
        after_backward = fused.full_state_dict()
        assert fused.step() and fused.global_steps == 1
        assert_same_states([after_backward], [fused.full_state_dict()], "backward vs step()")
        assert_same_states([plain.full_state_dict()], [after_backward], "plain vs fused")

    run_simulated(2, body)


def test_options_changed_between_backward_and_step_are_refused() -> None:
    """The update was applied in backward with the old learning rate: a new one set
    before step() would silently not apply, so step() names it."""
    case = ParityCase(widths=(5, 7, 3), seed=1)

    def body(comm: Communicator) -> str:
        engine = build_engine(case, comm, 3, FUSED)
        x, target = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        engine.optimizer.param_groups[0]["lr"] = 0.5
        with pytest.raises(RuntimeError, match="changed between backward and step") as raised:
            engine.step()
        return str(raised.value)

    assert "group 0: lr 0.01 -> 0.5" in run_simulated(1, body)[0]


def test_a_step_hook_added_after_initialize_is_refused_at_the_next_backward() -> None:
    case = ParityCase(widths=(5, 7, 3), seed=1)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3, FUSED)
        engine.optimizer.register_step_post_hook(lambda *_: None)
        x, target = micro_batch(case, comm.rank)
        with pytest.raises(ValueError, match="has step hooks now"):
            engine.backward(loss_of(case, engine(x), target))
        engine.optimizer._optimizer_step_post_hooks.clear()  # the hook removed: trains on
        engine.backward(loss_of(case, engine(x), target))
        assert engine.step()

    run_simulated(1, body)


def reduction_events(case: ParityCase) -> list[tuple[str, int]]:
    """Rank 0's sequence, over one fused step of 2 ranks, of ("launch", bucket),
    ("wait", bucket) (the last of its reduce-scatters landed) and ("step", bucket) (its
    on_reduced callback: the bucket's optimizer step)."""

    def body(comm: Communicator) -> list[tuple[str, int]]:
        engine = build_engine(case, comm, 3, FUSED)
        reducer = engine.gradients.reducer
        events: list[tuple[str, int]] = []
        stepper, launch, finish = reducer.on_reduced, reducer._launch, reducer._finish_oldest
        assert stepper is not None

        def logged_step(index: int) -> None:
            events.append(("step", index))
            stepper(index)

        def logged_launch(index: int) -> None:
            launch(index)
            events.append(("launch", index))

        def logged_finish() -> None:
            index = reducer._in_flight[0].members[0][0]
            finish()
            if reducer.buckets[index].pieces_left == 0:
                events.append(("wait", index))

        reducer.on_reduced, reducer._launch = logged_step, logged_launch  # type: ignore[method-assign]
        reducer._finish_oldest = logged_finish  # type: ignore[method-assign]
        x, target = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        assert engine.step()
        engine.close()
        return events

    return run_simulated(2, body)[0]


def test_a_bucket_steps_after_the_launch_its_landing_made_room_for() -> None:
    """A bucket that landed to make room for the next reduce-scatter is stepped after
    that launch, not between its landing and the launch: stepped there, the optimizer
    kept the link idle (grad_reducer._hand_over). Every bucket is stepped once."""
    case = normalised(ParityCase(widths=(32,) * 9, bucket_numel=2048, seed=2, coalesce_numel=0))
    events = reduction_events(case)
    launched = [b for kind, b in events if kind == "launch"]
    assert sorted(b for kind, b in events if kind == "step") == sorted(launched)
    made_room = 0
    for i, (kind, bucket) in enumerate(events):
        if kind != "wait":
            continue
        after = events[i + 1 :]
        next_wait = next((j for j, e in enumerate(after) if e[0] == "wait"), len(after))
        launch = next((j for j, e in enumerate(after[:next_wait]) if e[0] == "launch"), None)
        if launch is None:
            continue  # no launch waited for it (the end of backward)
        made_room += 1
        # -1: stepped inside its own landing (logged before the "wait", as it returned)
        stepped = after.index(("step", bucket)) if ("step", bucket) in after else -1
        assert stepped > launch, f"bucket {bucket} was stepped before the launch: {events}"
    assert made_room >= 2, f"the case must make room during backward: {events}"
