"""check_consistency="digest": as safe as comparing every call, nearly free once learned.

The spec (call_schedule.py): a program whose ranks agree never raises, gives the same
results as with "every", and after its loop's first iterations compares no call at all;
a program in which one rank calls something else at any point (another size, another
label, another collective, one call skipped), early or after the loop is learned, raises
CollectiveMismatchError on every rank naming each rank's call, before any data moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import CollectiveMismatchError, Communicator, run_simulated
from zero_comm.call_check import check_mode
from zero_comm.call_schedule import WINDOW

KINDS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")


@dataclass(frozen=True)
class Call:
    kind: str
    numel: int  # per rank for all_gather / reduce_scatter chunks
    label: str

    def run(self, comm: Communicator, seed: int) -> torch.Tensor:
        n = comm.world_size
        values = torch.arange(self.numel * n, dtype=torch.float32) + seed + comm.rank
        if self.kind == "all_reduce":
            comm.all_reduce(values, label=self.label)
            return values
        if self.kind == "all_gather":
            out = torch.empty(self.numel * n)
            comm.all_gather(out, values[: self.numel], label=self.label)
            return out
        if self.kind == "broadcast":
            comm.broadcast(values, src=self.numel % n, label=self.label)
            return values
        out = torch.empty(self.numel)
        comm.reduce_scatter(out, values, label=self.label)
        return out


calls = st.builds(
    Call,
    kind=st.sampled_from(KINDS),
    numel=st.integers(1, 6),
    label=st.sampled_from(["", "a", "b", "layer 1", "layer 2"]),
)


def other_call(call: Call, how: str) -> Call:
    if how == "numel":
        return Call(call.kind, call.numel + 1, call.label)
    if how == "label":
        return Call(call.kind, call.numel, call.label + " (another)")
    kinds = [k for k in KINDS if k != call.kind]
    return Call(kinds[call.numel % len(kinds)], call.numel, call.label)


def run_loop(
    comm: Communicator, step: list[Call], steps: int, change: tuple[int, int, int, str] | None
) -> tuple[list[torch.Tensor], list[int]]:
    """``steps`` repetitions of ``step``; ``change`` = (rank, step, position, how) makes one
    rank call something else (or nothing: how == "skip") once. Returns the results and the
    calls compared per step."""
    results, compared = [], []
    for s in range(steps):
        before = comm.compared_calls
        for p, call in enumerate(step):
            if change is not None and change[:3] == (comm.rank, s, p):
                if change[3] == "skip":
                    continue
                call = other_call(call, change[3])
            results.append(call.run(comm, seed=s))
        compared.append(comm.compared_calls - before)
    return results, compared


@settings(max_examples=40, deadline=None)
@given(
    world_size=st.integers(2, 4),
    step=st.lists(calls, min_size=1, max_size=12),
    steps=st.integers(4, 12),
)
def test_agreeing_ranks_never_raise_and_stop_comparing_once_the_loop_is_learned(
    world_size: int, step: list[Call], steps: int
) -> None:
    every = run_simulated(world_size, lambda c: run_loop(c, step, steps, None))
    digest = run_simulated(
        world_size, lambda c: run_loop(c, step, steps, None), check_consistency="digest"
    )
    for (a, _), (b, compared) in zip(every, digest, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        # A call is compared when its context (the WINDOW calls before it) is new: the
        # first calls, until the window has filled and the loop has come round once; from
        # then on, nothing, unless one context is followed by two different calls in the
        # loop (impossible when the step's calls are all different).
        assert compared[0] == len(step)
        if len(set(step)) == len(step):
            assert sum(compared) <= WINDOW + len(step), compared
            learned = 1 + math.ceil(WINDOW / len(step))
            assert compared[learned:] == [0] * max(0, steps - learned), compared


@settings(max_examples=40, deadline=None)
@given(
    world_size=st.integers(2, 4),
    step=st.lists(calls, min_size=2, max_size=8),
    data=st.data(),
)
def test_one_rank_calling_something_else_is_named_on_every_rank(
    world_size: int, step: list[Call], data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    when = data.draw(st.integers(0, 3), label="step")  # 0: before anything is learned
    where = data.draw(st.integers(0, len(step) - 2), label="position")
    how = data.draw(st.sampled_from(["numel", "label", "kind", "skip"]), label="how")
    if how == "skip" and step[where] == step[where + 1]:
        how = "numel"  # skipping one of two equal calls changes nothing: not a divergence

    def body(comm: Communicator) -> str:
        try:
            run_loop(comm, step, 4, (rank, when, where, how))
        except CollectiveMismatchError as exc:
            return str(exc)
        return ""

    messages = run_simulated(world_size, body, check_consistency="digest", timeout=30)
    for r, message in enumerate(messages):
        assert message.startswith(f"[rank {r}]"), messages
        assert "ranks disagree on the collective" in message, message
        assert all(f"rank {q}: " in message for q in range(world_size)), message


def test_the_modes_and_their_names() -> None:
    assert [check_mode(v) for v in (True, False, "every", "digest", "off")] == [
        "every", "off", "every", "digest", "off"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'digest'"):
        check_mode("sometimes")


LOOP = [Call("all_reduce", 4, "norm"), Call("all_gather", 2, "layer 0"), Call("broadcast", 3, "")]
DIVERGE = (1, 5, 1, "label")  # rank 1, step 5 (learned by then), the all-gather, its label


def test_after_a_divergence_among_ranks_that_went_ahead_the_communicator_refuses_work() -> None:
    """Ranks that went ahead have the collective in flight: nothing more can pair up."""

    def body(comm: Communicator) -> str:
        with pytest.raises(CollectiveMismatchError, match="ranks disagree"):
            run_loop(comm, LOOP, 6, DIVERGE)
        with pytest.raises(CollectiveMismatchError, match="stopped at the divergence of") as e:
            comm.all_reduce(torch.ones(2))
        return str(e.value)

    for message in run_simulated(3, body, check_consistency="digest"):
        assert "all_gather #" in message and "Fix the divergence and restart" in message


def test_where_waiting_ranks_cannot_join_the_diverging_rank_names_what_they_run() -> None:
    """A backend whose waits cannot look for posts (nccl): the others never compare, and
    the diverging rank says what the schedule had them calling."""

    def body(comm: Communicator) -> str:
        comm._posted_call = lambda: None  # type: ignore[method-assign]
        try:
            run_loop(comm, LOOP, 6, DIVERGE)
        except CollectiveMismatchError as exc:
            return str(exc)
        except Exception:
            return ""  # the ranks that went ahead: a timeout or the abandoned collective
        return "no error"

    messages = run_simulated(3, body, check_consistency="digest", timeout=1)
    assert messages[0] == messages[2] == "", messages  # they timed out
    assert "this rank called all_gather(float32, numel=2, 'layer 0 (another)')" in messages[1]
    assert (
        "where every rank agreed before on all_gather(float32, numel=2, 'layer 0')" in (messages[1])
    )


def test_looking_for_posts_survives_a_store_that_has_gone() -> None:
    """Rank 0 hosts the store and may exit as soon as its last collective completes, while
    another rank still waits for that collective's data (which arrives): a failing store
    must not turn that wait into an error (it did: 'Connection reset by peer')."""
    from zero_comm.torch_backend import TorchCommunicator

    class GoneStore:
        def add(self, key: str, value: int) -> int:
            raise RuntimeError("Connection reset by peer")

    comm = TorchCommunicator.__new__(TorchCommunicator)
    comm._calls_store, comm._calls_prefix, comm._posts_seen = GoneStore(), "p", 0
    assert comm._posted_call() is None
