"""Stages 1 and 2 gather each bucket while the optimizer steps the next, bit for bit.

The masters step bucket by bucket (master_weights, optimizer_parts) and the replicated
parameters launch a bucket's all-gather as soon as its slice is stepped
(replicated_params). What must hold:

- stepping part of an optimizer's tensors at a time equals one step over all of them,
  bit for bit, parameters and ``state_dict()``, for every optimizer allowed to
  (the pure test below, every implementation torch has on this device);
- stages 1 and 2 still equal stage 0 bit for bit, compute parameters included (the
  parity suite compares the float32 masters only), with every optimizer of the parity
  suite, float32 / bfloat16 / float16 (loss-scaler skips), accumulation, clipping, two
  groups with their own options, many buckets, pieces, and collectives whose results
  land only at ``wait()`` (a missing wait shows up as a mismatch);
- the optimizer's state after a step in parts equals its state after a step at once;
- the overlap is real: the first all-gather is issued before the last bucket is stepped
  (on the code before this change every gather came after the one optimizer step).

Assertions are ``torch.equal``: no tolerance.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import DTYPES, OPTIMIZERS, ParityCase, build_engine, loss_of, micro_batch, normalised
from torch.optim.optimizer import register_optimizer_step_post_hook

from zero_comm import Communicator, run_simulated
from zero_core import master_weights
from zero_core.optimizer_parts import IN_PARTS, step_part, steps_in_parts

Trace = list[dict[str, torch.Tensor]]


# ------------------------------------------------------------- the optimizer alone
def implementations(name: str) -> list[dict[str, Any]]:
    """The implementations torch runs on CPU for ``name``: for-loop, foreach and, where
    torch has a CPU kernel, fused."""
    options: list[dict[str, Any]] = [{"foreach": False}, {"foreach": True}]
    if name in ("sgd", "adam", "adamw", "adagrad"):
        options.append({"fused": True})
    return options


EXTRA_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "sgd": [{}, {"nesterov": True, "weight_decay": 0.01}, {"momentum": 0.0}],
    "adam": [{}, {"amsgrad": True, "weight_decay": 0.05}],
    "adamw": [{}, {"amsgrad": True}],
    "adagrad": [{}, {"lr_decay": 0.1, "weight_decay": 0.02}],
    "rmsprop": [{}, {"momentum": 0.5, "centered": True, "weight_decay": 0.01}],
}


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    implementation=st.integers(0, 2),
    extra=st.integers(0, 2),
    sizes=st.lists(st.integers(0, 300), min_size=2, max_size=6),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    steps=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_stepping_in_parts_equals_one_step_for_every_allowed_optimizer(
    name: str,
    implementation: int,
    extra: int,
    sizes: list[int],
    cuts: list[int],
    steps: int,
    seed: int,
) -> None:
    """Tensors in two groups (the second with its own lr), stepped ``steps`` times at
    once or in consecutive parts: every tensor and the whole ``state_dict()`` equal."""
    optimizer_class, options = OPTIMIZERS[name]
    impls = implementations(name)
    extras = EXTRA_OPTIONS[name]
    options = {**options, **impls[implementation % len(impls)], **extras[extra % len(extras)]}
    generator = torch.Generator().manual_seed(seed)
    initial = [torch.randn(n, generator=generator) for n in sizes]
    grads = [[torch.randn(n, generator=generator) for n in sizes] for _ in range(steps)]

    def run(in_parts: bool) -> tuple[list[torch.Tensor], dict[str, Any]]:
        tensors = [torch.nn.Parameter(v.clone()) for v in initial]
        half = len(tensors) // 2
        groups: list[dict[str, Any]] = [
            {"params": tensors[:half]},
            {"params": tensors[half:], "lr": options["lr"] * 0.5},
        ]
        optimizer = optimizer_class(groups, **options)
        assert steps_in_parts(optimizer)
        for step in range(steps):
            pairs = list(zip(tensors, grads[step], strict=True))
            if not in_parts:
                step_part(optimizer, pairs)
                continue
            position = 0
            for cut in [*cuts, len(pairs)]:
                step_part(optimizer, pairs[position : position + cut])
                position += cut
                if position >= len(pairs):
                    break
        return [t.detach() for t in tensors], optimizer.state_dict()

    whole, whole_state = run(False)
    parts, parts_state = run(True)
    for a, b in zip(whole, parts, strict=True):
        assert torch.equal(a, b)
    assert_same_state_dicts(whole_state, parts_state)


def assert_same_state_dicts(a: Any, b: Any) -> None:
    """Equal structure, and every tensor equal bit for bit (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same_state_dicts(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state_dicts(x, y)
    else:
        assert a == b


def test_only_the_allowed_optimizers_without_hooks_step_in_parts() -> None:
    """A subclass may override step() and a hook would run once per part: one call."""

    class MyAdamW(torch.optim.AdamW):
        pass

    p = torch.nn.Parameter(torch.zeros(3))
    assert all(steps_in_parts(cls([p])) for cls in IN_PARTS)
    assert not steps_in_parts(MyAdamW([p]))
    hooked = torch.optim.AdamW([p])
    handle = hooked.register_step_post_hook(lambda *_: None)
    assert not steps_in_parts(hooked)
    handle.remove()
    assert steps_in_parts(hooked)


# --------------------------------------------------------------------- the engine
class Recorded(NamedTuple):
    states: Trace  # the full float32 state after each applied step
    params: Trace  # the compute parameters after each applied step (what forward sees)
    calls: int  # optimizer.step() calls
    tiles: int  # bucket slices of the masters (each one or more tiles)
    state_dict: dict[str, Any]  # the optimizer's, at the end


def train_recording(case: ParityCase, comm: Communicator, stage: int) -> Recorded:
    """Train ``case`` at ``stage``, recording what :class:`Recorded` lists."""
    case = normalised(case)
    engine = build_engine(case, comm, stage)
    calls = [0]
    step = engine.optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return step(*args, **kwargs)

    engine.optimizer.step = counted  # type: ignore[method-assign]
    states, params = [], []
    for s in range(case.steps):
        for micro in range(case.accumulation):
            index = (s * case.accumulation + micro) * comm.world_size + comm.rank
            x, target = micro_batch(case, index)
            loss = loss_of(case, engine(x.to(DTYPES[case.dtype]) if not case.vocab else x), target)
            engine.backward(loss)
            if engine.step():
                states.append(engine.full_state_dict())
                params.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    tiles = len(engine.masters.buckets)  # each bucket slice has its tiles
    recorded = Recorded(states, params, calls[0], tiles, engine.optimizer.state_dict())
    engine.close()
    return recorded


def assert_same_traces(expected: Trace, actual: Trace, what: str) -> None:
    assert len(expected) == len(actual), f"{what}: {len(actual)} steps applied, not {len(expected)}"
    for step, (a, b) in enumerate(zip(expected, actual, strict=True)):
        assert a.keys() == b.keys(), f"{what}: keys differ"
        for key in a:
            assert torch.equal(a[key], b[key]), f"{what}: step {step}, {key} differs"


def overlap_cases() -> Any:
    @st.composite
    def cases(draw: Any) -> ParityCase:
        vocab = draw(st.sampled_from([0, 11]))
        widths = st.lists(st.sampled_from([2, 3, 7, 15, 33]), min_size=2, max_size=4)
        return ParityCase(
            widths=tuple(draw(widths)),
            vocab=vocab,
            tie=vocab > 0 and draw(st.booleans()),
            freeze_first=draw(st.booleans()),
            two_groups=draw(st.booleans()),
            dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            optimizer=draw(st.sampled_from(sorted(OPTIMIZERS))),
            accumulation=draw(st.sampled_from([1, 2])),
            clip=draw(st.sampled_from([None, 0.05, 1e3])),
            # Small buckets: many parts per step; 64 and 100 make pieces (oversized).
            bucket_numel=draw(st.sampled_from([64, 100, 300, 1 << 20])),
            steps=3,
            seed=draw(st.integers(0, 10_000)),
        )

    return cases()


@settings(max_examples=20, deadline=None)
@given(case=overlap_cases(), world_size=st.sampled_from([2, 3, 4]), deferred=st.booleans())
def test_stages_1_and_2_stepped_bucket_by_bucket_equal_stage_0(
    case: ParityCase, world_size: int, deferred: bool
) -> None:
    """Masters and compute parameters after every step equal stage 0's; and where a
    stage has more than one bucket the optimizer really was stepped in parts."""

    def body(comm: Communicator) -> None:
        reference = train_recording(case, comm, 0)
        assert reference.calls == len(reference.states)  # stage 0: nothing to gather
        for stage in (1, 2):
            got = train_recording(case, comm, stage)
            assert_same_traces(reference.states, got.states, f"stage {stage} masters")
            assert_same_traces(reference.params, got.params, f"stage {stage} parameters")
            assert got.calls == len(got.states) * got.tiles  # one step per bucket slice

    run_simulated(world_size, body, defer_outputs=deferred)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_state_after_parts_equals_one_step(
    stage: int, optimizer: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same engine stepped at once (steps_in_parts patched to refuse) and bucket by
    bucket: equal optimizer state_dict() and parameters, and more calls in parts."""
    case = ParityCase(
        widths=(7, 15, 3), optimizer=optimizer, dtype=dtype, two_groups=True,
        bucket_numel=64, steps=3, accumulation=2, clip=0.05,
    )  # fmt: skip

    def body(comm: Communicator) -> Recorded:
        return train_recording(case, comm, stage)

    parts = run_simulated(3, body)
    monkeypatch.setattr(master_weights, "steps_in_parts", lambda optimizer: False)
    whole = run_simulated(3, body)
    for at_once, in_parts in zip(whole, parts, strict=True):
        assert_same_traces(at_once.states, in_parts.states, "masters")
        assert_same_traces(at_once.params, in_parts.params, "parameters")
        assert_same_state_dicts(at_once.state_dict, in_parts.state_dict)
        assert at_once.calls == case.steps
        assert in_parts.calls == case.steps * in_parts.tiles > case.steps


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_bucket_is_gathered_before_the_next_is_stepped(stage: int, dtype: str) -> None:
    """The order of optimizer steps and all-gathers on every rank: step b0, gather b0,
    step b1, gather b1, ... (before this change: one step, then every gather)."""
    # Eight buckets (a weight or a bias each) of 256 elements padded: one all-gather each.
    case = ParityCase(widths=(15, 15, 15, 15, 15), dtype=dtype, bucket_numel=256, steps=1)

    def body(comm: Communicator) -> list[str]:
        events: list[str] = []
        gather = comm.all_gather

        def recorded(*args: Any, **kwargs: Any) -> Any:
            events.append("gather")
            return gather(*args, **kwargs)

        comm.all_gather = recorded  # type: ignore[method-assign]
        engine = build_engine(case, comm, stage)
        step = engine.optimizer.step

        def stepped(*args: Any, **kwargs: Any) -> Any:
            events.append("step")
            return step(*args, **kwargs)

        engine.optimizer.step = stepped  # type: ignore[method-assign]
        buckets = sum(len(layout.buckets) for layout in engine.layouts)
        events.clear()
        x, _ = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x.to(DTYPES[case.dtype])), torch.zeros(0)))
        assert engine.step()
        engine.close()
        assert buckets == 8
        assert all(b.layout.padded_numel <= 256 for lay in engine.layouts for b in lay.buckets)
        return events

    for events in run_simulated(2, body):
        last_step = len(events) - 1 - events[::-1].index("step")
        assert events.index("gather") < last_step, events
        assert events == ["step", "gather"] * 8, events


def test_an_optimizer_with_step_hooks_steps_at_once_and_still_equals_stage_0() -> None:
    """A step hook would run once per part: one optimizer.step(), the gathers after it."""
    case = ParityCase(widths=(7, 15, 3), bucket_numel=64, steps=2, dtype="bfloat16")
    hook_calls = [0]

    def hook(*_: Any) -> None:
        hook_calls[0] += 1

    def body(comm: Communicator) -> None:
        reference = train_recording(case, comm, 0)
        got = train_recording(case, comm, 1)
        assert got.calls == case.steps < case.steps * got.tiles
        assert_same_traces(reference.states, got.states, "stage 1")
        assert_same_traces(reference.params, got.params, "stage 1 parameters")

    handle = register_optimizer_step_post_hook(hook)
    try:
        run_simulated(2, body)
    finally:
        handle.remove()
    assert hook_calls[0] == 2 * 2 * case.steps  # two ranks, stages 0 and 1


def test_values_handed_over_twice_before_a_publish_are_refused() -> None:
    """A bucket already launched would not see the second values: refused, naming the
    bucket (on every rank alike, so the publish after it still pairs up)."""
    case = ParityCase(widths=(7, 15, 3), bucket_numel=64, steps=1)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 1)
        engine.masters.visit(engine.compute_params.take_master_values)
        with pytest.raises(RuntimeError, match=r"\[rank \d\] bucket 0 of group 0 was handed more"):
            engine.masters.visit(engine.compute_params.take_master_values)
        engine.compute_params.publish()

    run_simulated(2, body)
