"""Every stage reduces gradients during backward, bit for bit as stage 0 after it.

A chunk (stage 0's all-reduce) or bucket (stage 1's reduce-scatter) is launched once every
parameter in it has its gradient, in one canonical order on every rank; what is left is
launched after backward. Each element still goes through the same collective, so the
trained states equal the non-overlapped path's (``overlap_comm=False``) and stage 0's bit
for bit, with accumulation, parameters that get no gradient, a user that sets ``.grad``
to None, and asynchronous results delivered only at ``wait()`` (``defer_outputs``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import DTYPES, assert_same_states
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_core
from zero_comm import Communicator, run_simulated


class SometimesUnused(nn.Module):
    """Linear layers with tanh between them; ``tail`` runs on odd micro-batches only and
    ``never`` never runs, so their chunks complete only after backward."""

    def __init__(self, widths: tuple[int, ...], seed: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.tail = nn.Linear(widths[-1], widths[-1])
        self.never = nn.Linear(3, 3)
        generator = torch.Generator().manual_seed(seed)  # never the rank threads' global RNG
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor, use_tail: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.tail(x) if use_tail else x


def train(
    comm: Communicator,
    *,
    stage: int,
    overlap: bool,
    widths: tuple[int, ...],
    dtype: str = "float32",
    accumulation: int = 1,
    bucket_numel: int = 1 << 20,
    in_flight: int = 2,
    clip: float | None = None,
    user_sets_grad_to_none: bool = False,
    steps: int = 3,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """The full float32 state after each of ``steps`` updates."""
    model = SometimesUnused(widths, seed)
    config = zero_core.ZeroConfig(
        stage=stage,
        param_dtype=DTYPES[dtype],
        overlap_comm=overlap,
        gradient_accumulation_steps=accumulation,
        bucket_numel=bucket_numel,
        max_buckets_in_flight=in_flight,
        clip_grad_norm=clip,
    )
    engine = zero_core.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, comm
    )
    states = []
    for step in range(steps):
        for micro in range(accumulation):
            index = (step * accumulation + micro) * comm.world_size + comm.rank
            generator = torch.Generator().manual_seed(seed * 7919 + index)
            x = torch.randn(4, widths[0], generator=generator)
            if user_sets_grad_to_none:
                model.zero_grad(set_to_none=True)
            engine.backward(engine(x, index % 2 == 1).float().square().mean())
            if engine.step():
                states.append(engine.full_state_dict())
    engine.close()
    return states


@settings(max_examples=8, deadline=None)
@given(
    world_size=st.sampled_from([3, 2, 1, 4]),
    widths=st.lists(st.sampled_from([33, 130, 200]), min_size=2, max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    accumulation=st.sampled_from([1, 2, 3]),
    bucket_numel=st.sampled_from([300, 2000, 5000, 1 << 20]),
    in_flight=st.sampled_from([1, 2, 3]),
    clip=st.sampled_from([None, 0.05]),
    user_sets_grad_to_none=st.booleans(),
    deferred=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_overlapped_stages_equal_the_non_overlapped_stage_0_bit_for_bit(
    world_size: int, deferred: bool, **case: Any
) -> None:
    """World size 3 is drawn first: at N = 2 a sum of two terms has one order only.

    Stage 2 (stage 3's reducer too; stage 3 itself needs every rank to run the same
    modules) always reduces during backward, from pooled staging buffers that are not
    zeroed whole: ``tail`` and ``never`` check that a parameter without a gradient in a
    micro-step is reduced as zeros, not as what a pooled buffer held before."""
    plain = {k: v for k, v in case.items() if k != "user_sets_grad_to_none"}

    def body(comm: Communicator) -> None:
        reference = train(comm, stage=0, overlap=False, **plain)
        for stage, overlap in [(0, True), (0, False), (1, True), (1, False), (2, True)]:
            states = train(comm, stage=stage, overlap=overlap, **case)
            assert_same_states(reference, states, f"stage {stage}, overlap_comm={overlap}")

    run_simulated(world_size, body, defer_outputs=deferred)


def recording(comm: Communicator, events: list[str], in_flight: list[int]) -> None:
    """Log every gradient collective ``comm`` issues into ``events``; ``in_flight`` gets
    the number outstanding after each launch."""
    outstanding = [0]

    def wrap(collective: Callable[..., Any]) -> Callable[..., Any]:
        def issued(*args: Any, **kwargs: Any) -> Any:
            events.append(f"collective {kwargs.get('label', '')}")
            handle = collective(*args, **kwargs)
            if not kwargs.get("async_op"):
                return handle
            outstanding[0] += 1
            in_flight.append(outstanding[0])
            wait = handle.wait

            def waited() -> Any:
                outstanding[0] -= 1
                return wait()

            handle.wait = waited
            return handle

        return issued

    comm.all_reduce = wrap(comm.all_reduce)  # type: ignore[method-assign]
    comm.reduce_scatter = wrap(comm.reduce_scatter)  # type: ignore[method-assign]


@pytest.mark.parametrize("stage", [0, 1])
def test_the_first_gradient_collective_is_issued_before_backward_reaches_the_first_layer(
    stage: int,
) -> None:
    """Hooks of the last layers fire first; their chunks must be on the wire while the
    first layer's gradient is still being computed (the code before this change issued
    every gradient collective after backward: this test failed on it)."""

    def body(comm: Communicator) -> None:
        # Every parameter used: an unused one late in the order would (correctly) hold
        # back every chunk launched after it until backward ends.
        model = nn.Sequential(*(nn.Linear(130, 130) for _ in range(4)))
        config = zero_core.ZeroConfig(stage=stage, bucket_numel=4096, max_buckets_in_flight=2)
        engine = zero_core.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config, comm
        )
        events: list[str] = []
        in_flight: list[int] = []
        for name, p in model.named_parameters():
            # Registered after the engine's hooks, so each fires after the engine's.
            p.register_post_accumulate_grad_hook(lambda _, n=name: events.append(f"hook {n}"))  # type: ignore[misc]
        recording(comm, events, in_flight)
        engine.backward(engine(torch.ones(2, 130)).square().sum())
        first_layer = min(i for i, e in enumerate(events) if e.startswith("hook 0."))
        collectives = [i for i, e in enumerate(events) if e.startswith("collective")]
        assert len(collectives) > 2, events
        assert collectives[0] < first_layer, f"nothing issued before the first layer: {events}"
        assert max(in_flight) <= config.max_buckets_in_flight, in_flight
        engine.step()

    run_simulated(2, body)


class Twice(nn.Module):
    """One layer applied twice under reentrant checkpointing: its parameters get two
    gradients in one backward (one per checkpoint's own backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=True, preserve_rng_state=False)
        return checkpoint(self.a, torch.tanh(h), use_reentrant=True, preserve_rng_state=False)  # type: ignore[no-any-return]


def train_twice(comm: Communicator, stage: int, overlap: bool) -> dict[str, torch.Tensor]:
    model = Twice()
    config = zero_core.ZeroConfig(stage=stage, bucket_numel=1, overlap_comm=overlap)
    engine = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config, comm)
    x = torch.full((2, 6), 0.5 + comm.rank, requires_grad=True)
    engine.backward(engine(x).sum())
    engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_second_gradient_after_its_chunk_was_launched_is_an_error(stage: int) -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(RuntimeError, match=r"\[rank \d\] parameter a\.\w+ received a second"):
            train_twice(comm, stage, overlap=True)

    run_simulated(1, body)


def test_without_overlap_a_second_gradient_is_summed_as_stage_0_sums_it() -> None:
    """overlap_comm=False is the remedy the error names: it trains, and stage 1 equals
    stage 0."""

    def body(comm: Communicator) -> None:
        zero, one = train_twice(comm, 0, overlap=False), train_twice(comm, 1, overlap=False)
        assert_same_states([zero], [one], "stage 1 vs stage 0, reentrant checkpointing")

    run_simulated(3, body)
