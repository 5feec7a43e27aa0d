"""Stage 3's coalesced gathers (param_gatherer, ``gather_coalesce_numel``): the units a
prefetch starts together share one all-gather, with the bits of one gather per unit.

The bits against stage 0 are the hypothesis parity suite's (parity_cases draws
``gather_coalesce_numel``); the prefetch counts are test_stage3's. Here: every gather path
that can coalesce (plain, qwZ, hpZ's secondary gather in backward) gives the same bits
coalesced or not, and does coalesce."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity import ParityCase, assert_same_states, build_engine, run_steps

from zero_comm import Communicator, run_simulated
from zero_core import param_gatherer

# Five Linear units of 960-1600 elements; with the backward head off, backward gathers too.
CASE = ParityCase(widths=(24, 40, 40, 40, 40, 24), dtype="float32", optimizer="adam",
                  steps=3, persistence_threshold=64, seed=11)  # fmt: skip
NO_HEAD = {"keep_backward_head": False}

Run = tuple[list[dict[str, torch.Tensor]], int, int, float, float]


def run(settings: dict[str, Any], gather_coalesce_numel: int, **case: Any) -> Run:
    """4 ranks, 2 per node: rank 0's states after each step; in the steps after the first
    (which records the order): its all-gathers over every rank and inside a node (hpZ),
    and the total and inter-node bytes of all-gathers, summed over the ranks."""
    case = ParityCase(**{**CASE.__dict__, "gather_coalesce_numel": gather_coalesce_numel, **case})

    def body(comm: Communicator) -> Run:
        engine = build_engine(case, comm, 3, {**NO_HEAD, **settings})
        states = run_steps(engine, case, comm, range(1))
        communicators = [c for c in (comm, engine.secondary) if c is not None]
        for each in communicators:
            each.stats.reset()
        states += run_steps(engine, case, comm, range(1, case.steps))
        inside = 0 if engine.secondary is None else engine.secondary.stats["all_gather"].calls
        counts = [each.stats["all_gather"] for each in communicators]
        volume = float(sum(count.volume_bytes for count in counts))
        inter = float(sum(count.inter_node_bytes for count in counts))
        calls = comm.stats["all_gather"].calls
        engine.close()
        return states, calls, inside, volume, inter

    ranks = run_simulated(4, body, ranks_per_node=2)
    states, calls, inside = ranks[0][:3]
    return states, calls, inside, sum(r[3] for r in ranks), sum(r[4] for r in ranks)


SETTINGS = [{}, {"quantize_weights": True}, {"hpz_partition_size": 2},
            {"quantize_weights": True, "hpz_partition_size": 2}]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS, ids=["plain", "qwZ", "hpZ", "qwZ+hpZ"])
def test_coalesced_gathers_give_the_bits_and_bytes_of_one_gather_per_unit(
    settings: dict[str, Any],
) -> None:
    alone, alone_calls, alone_inside, alone_volume, alone_inter = run(settings, 0)
    coalesced, calls, inside, volume, inter = run(settings, 1 << 20)
    assert_same_states(alone, coalesced, f"{settings}: coalesced against one gather per unit")
    assert calls < alone_calls, (calls, alone_calls)
    assert (volume, inter) == (alone_volume, alone_inter)
    assert inter > 0
    if "hpz_partition_size" in settings:  # backward's gathers stay inside the node
        assert 0 < inside < alone_inside, (inside, alone_inside)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_shards_offloaded_to_host_or_disk_coalesce_with_the_same_bits(tier: str) -> None:
    """The shards are taken from their tier for the coalesced send and given back at once."""
    alone, alone_calls, *_ = run({}, 0, offload_params=tier)
    coalesced, calls, *_ = run({}, 1 << 20, offload_params=tier)
    assert_same_states(alone, coalesced, f"parameters on {tier}")
    assert calls < alone_calls, (calls, alone_calls)


def test_hierarchical_gathers_are_never_coalesced(monkeypatch: pytest.MonkeyPatch) -> None:
    """hierarchical_all_gather is two collectives per buffer; it keeps one gather per unit.
    (Its collectives run on the shard group's sub-communicators, so they are counted here
    at the gatherer's calls.)"""
    counts = {"hierarchical": 0, "coalesced": 0}

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1  # the simulated ranks are threads: all four count here
            return function(*args, **kwargs)

        return call

    for name, attribute in (("hierarchical", "hierarchical_all_gather"),
                            ("coalesced", "all_gather_coalesced")):  # fmt: skip
        monkeypatch.setattr(
            param_gatherer, attribute, counted(name, getattr(param_gatherer, attribute))
        )
    settings = {"shard_group_size": 2, "hierarchical_gather": True}
    alone, *_ = run(settings, 0)
    alone_counts = dict(counts)
    coalesced, *_ = run(settings, 1 << 20)
    assert_same_states(alone, coalesced, "hierarchical gathers")
    assert alone_counts["hierarchical"] > 0 and alone_counts["coalesced"] == 0
    assert counts == {"hierarchical": 2 * alone_counts["hierarchical"], "coalesced": 0}
