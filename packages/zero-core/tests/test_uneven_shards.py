"""Uneven shards (issue 52) as properties: weighted shares that tile the buffer on BLOCK
boundaries in proportion to the weights; the padded-slice collectives; the config's
checks and refusals; and the memory each rank holds following its weight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParityCase, build_engine, normalised

import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.flat_layout import FlatLayout, weighted_units
from zero_core.grad_norm import BLOCK
from zero_core.group_layout import GroupLayout
from zero_core.uneven_shards import UnevenShardComm, gather_counts

numels = st.lists(st.one_of(st.integers(0, 300), st.sampled_from([0, 1, 128, 1031])), max_size=6)
weight_lists = st.lists(st.sampled_from([0.5, 1, 1, 2, 3, 7.5]), min_size=1, max_size=5)


@given(st.integers(0, 5000), weight_lists)
def test_weighted_units_add_up_give_each_rank_one_and_follow_the_weights(
    extra: int, weights: list[float]
) -> None:
    units = len(weights) + extra
    parts = weighted_units(units, weights)
    assert sum(parts) == units and min(parts) >= 1
    total = sum(weights)
    for part, w in zip(parts, weights, strict=True):
        # one unit given first, then the cumulative share rounded: off by at most 1 + 1
        assert abs(part - 1 - extra * w / total) <= 1.0 + 1e-9


@given(numels, weight_lists, st.sampled_from([1, 2, 16, BLOCK]))
def test_uneven_shards_tile_the_buffer_aligned_and_cover_every_element_once(
    sizes: list[int], weights: list[float], alignment: int
) -> None:
    n = len(weights)
    layout = FlatLayout.of(sizes, n, alignment, alignment, weights)
    assert len(layout.shard_sizes) == n
    assert all(s > 0 and s % alignment == 0 for s in layout.shard_sizes)
    assert sum(layout.shard_sizes) == layout.padded_numel >= layout.numel
    assert layout.shard_numel == max(layout.shard_sizes)
    assert layout.wire_numel == n * layout.shard_numel
    stop = 0
    seen = [[0] * size for size in sizes]
    for rank in range(n):
        shard = layout.shard_flat_range(rank)
        assert shard.start == stop and shard.size == layout.shard_sizes[rank]
        stop = shard.stop
        for piece in layout.shard_pieces(rank):
            assert piece.flat_range.shift(shard.start) == piece.local_range
            for i in range(piece.param_range.start, piece.param_range.stop):
                seen[piece.param_index][i] += 1
    assert stop == layout.padded_numel
    assert seen == [[1] * size for size in sizes]


def test_weights_two_to_one_give_two_thirds_of_a_large_bucket() -> None:
    layout = FlatLayout.of([3 * BLOCK * 1000], 2, BLOCK, BLOCK, [2, 1])
    assert layout.shard_sizes == (2000 * BLOCK, 1000 * BLOCK)


@given(numels, weight_lists, st.sampled_from([1, 200, 5000]))
def test_group_layouts_of_every_rank_agree_on_pieces_offsets_and_rows(
    sizes: list[int], weights: list[float], bucket_numel: int
) -> None:
    """Built for rank r, a group layout's own numbers are r's, and what it says of any
    other rank equals what that rank's own layout says; rows of every rank list every
    parameter's BLOCK rows once."""
    n = len(weights)
    layouts = [GroupLayout.build(sizes, n, bucket_numel, weights=weights, rank=r) for r in range(n)]
    for r, layout in enumerate(layouts):
        assert layout.shard_numel == layout.shard_numel_of(r)
        assert sum(b.slice_numel for b in layout.buckets) == layout.shard_numel
        for other in range(n):
            assert layout.local_pieces(other) == layouts[other].local_pieces(other)
        offsets = [b.local_offset for b in layout.buckets]
        assert offsets == sorted(offsets) and (not offsets or offsets[0] == 0)
    keys = [key for r in range(n) for key in layouts[0].row_keys(r) if key[0] < len(sizes)]
    expected = [(i, row) for i, size in enumerate(sizes) for row in range(-(-size // BLOCK))]
    assert sorted(keys) == expected


def test_even_layouts_are_unchanged_without_weights() -> None:
    """None keeps today's layout exactly (the homogeneous run's bits and files)."""
    even = GroupLayout.build([5, 700, 3, 4000], 3, 1000)
    assert not even.uneven and even.weights is None
    for b in even.buckets:
        assert len(set(b.local_offsets)) == 1 and b.layout.shard_sizes == (b.slice_numel,) * 3
        assert b.layout.padded_numel == 3 * b.slice_numel == b.layout.wire_numel


@pytest.mark.parametrize("weights", [(2.0, 1.0), (1.0, 3.0, 1.5)])
def test_padded_slice_collectives_equal_the_reference(weights: tuple[float, ...]) -> None:
    """all_gather of uneven slices gives the concatenation (N broadcasts, no padding);
    reduce_scatter gives each rank the rank-ordered sum of its slice, its wire N x the
    largest slice."""
    n = len(weights)
    numel = BLOCK * 9
    sizes = [u * BLOCK for u in weighted_units(9, weights)]
    data = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]

    def body(comm: Communicator) -> None:
        uneven = UnevenShardComm(comm, weights)
        assert uneven.sizes(numel) == tuple(sizes)
        start = sum(sizes[: comm.rank])
        mine = data[comm.rank][start : start + sizes[comm.rank]].clone()
        full = torch.empty(numel)
        handle = uneven.all_gather(full, mine, async_op=True)
        assert handle is not None
        handle.wait()
        expected = torch.cat([data[r][sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(n)])
        assert torch.equal(full, expected)
        assert comm.stats["broadcast"].buffer_elements == numel  # sum(s): no padding
        assert comm.stats["broadcast"].calls == n
        out = torch.empty(sizes[comm.rank])
        uneven.reduce_scatter(out, data[comm.rank])
        assert comm.stats["reduce_scatter"].buffer_elements == n * max(sizes)
        total = data[0].clone()
        for r in range(1, n):
            total = total + data[r]
        assert torch.equal(out, total[start : start + sizes[comm.rank]])
        rows = torch.full((comm.rank + 1,), float(comm.rank))
        everyone = gather_counts(uneven, rows, list(range(1, n + 1)))
        assert everyone.tolist() == [float(r) for r in range(n) for _ in range(r + 1)]
        with pytest.raises(ValueError, match="share of the bucket"):
            uneven.all_gather(full, torch.empty(1))

    run_simulated(n, body)


def test_config_normalises_and_checks_the_weights() -> None:
    assert zero_core.ZeroConfig(stage=2, shard_weights=[2, 1]).shard_weights == (2.0, 1.0)
    assert zero_core.ZeroConfig(stage=2, shard_weights="2,1").shard_weights == (2.0, 1.0)
    assert zero_core.ZeroConfig(stage=2, shard_weights="auto").shard_weights == "auto"
    for bad in ([2, 0], [1, -1], [], [1, float("nan")], "two,one", [True, 1]):
        with pytest.raises(ValueError, match="shard_weights"):
            zero_core.ZeroConfig(stage=2, shard_weights=bad)


@pytest.mark.parametrize(
    "setting",
    [
        {"stage": 3, "hpz_partition_size": 2},
        {"stage": 3, "quantize_weights": True},
        {"stage": 2, "quantize_gradients": "int8"},
        {"stage": 2, "shard_group_size": 2},
        {"stage": 3, "hierarchical_gather": True},
    ],
)
def test_what_does_not_combine_is_refused_by_name(setting: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="cannot be combined with"):
        zero_core.ZeroConfig(shard_weights=[2, 1], **setting)  # type: ignore[arg-type]


CASE = normalised(
    ParityCase(
        widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, dtype="bfloat16", bucket_numel=300
    )
)


@pytest.mark.parametrize("weights", [[1, 1, 1], "auto"])
def test_a_weight_list_of_the_wrong_length_or_unresolved_auto_is_named(weights: object) -> None:
    def body(comm: Communicator) -> None:
        build_engine(CASE, comm, 2, {"shard_weights": weights})

    with pytest.raises(SimulatedRankError) as error:
        run_simulated(2, body)
    assert "shard_weights" in str(error.value.__cause__)


@settings(max_examples=1, deadline=None)
@given(st.just(None))
def test_stage_0_accepts_weights_and_changes_nothing(_: None) -> None:
    def body(comm: Communicator) -> bool:
        engine = build_engine(CASE, comm, 0, {"shard_weights": [2, 1]})
        return all(not layout.uneven for layout in engine.layouts)

    assert run_simulated(2, body) == [True, True]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_ranks_sharded_states_follow_its_weight(stage: int) -> None:
    """memory_report: rank 0 of weights 3:1 holds about 3x rank 1's master weights and
    optimizer states (and gradient shard at stages 2-3, parameter shard at stage 3);
    the pair adds up to the even run's pair (up to BLOCK rounding per bucket)."""
    case = normalised(ParityCase(widths=(64, 512, 512, 64), optimizer="adam", dtype="bfloat16",
                                 bucket_numel=1 << 20))  # fmt: skip

    def body(comm: Communicator, weights: list[int] | None) -> tuple[int, int]:
        engine = build_engine(case, comm, stage, {"shard_weights": weights})
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(comm.rank))
        engine.backward(engine(x.to(torch.bfloat16)).float().square().mean())
        engine.step()
        report = engine.memory_report()
        engine.close()
        return report.master_weights, report.optimizer_states

    uneven = run_simulated(2, lambda comm: body(comm, [3, 1]))
    even = run_simulated(2, lambda comm: body(comm, None))
    for k in range(2):
        ratio = uneven[0][k] / uneven[1][k]
        assert 2.8 < ratio < 3.2, (k, uneven)
        assert abs(uneven[0][k] + uneven[1][k] - even[0][k] - even[1][k]) <= 4 * 4 * BLOCK * 8


def test_zero_estimate_gives_each_rank_its_weighted_share(capsys: pytest.CaptureFixture) -> None:
    """zero-estimate --shard-weights: rank r's sharded states are Ψ w_r / sum(w) of the
    paper's terms; the ranks add up to N times the even rank's; stage 0 is unchanged."""
    import json

    from zero_core.estimate.command import main

    main(["--params", "1.2e9", "--world-size", "3", "--shard-weights", "3,2,1", "--json"])
    rows = json.loads(capsys.readouterr().out)
    for stage in ("1", "2", "3"):
        ranks = rows[stage]["ranks"]
        total = sum(entry["device"] for entry in ranks)
        assert total == pytest.approx(3 * rows[stage]["device"])
        sharded = [entry["optimizer_states"] for entry in ranks]
        assert sharded[0] == pytest.approx(3 * sharded[2]) and sharded[1] == pytest.approx(
            2 * sharded[2]
        )
    assert rows["3"]["ranks"][0]["device"] == pytest.approx(16 * 1.2e9 / 2)  # (2+2+12)Ψ/2
    assert all(e["device"] == rows["0"]["device"] for e in rows["0"]["ranks"])
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--world-size", "3", "--shard-weights", "2,1"])
