"""Shard arithmetic as properties: disjoint, covering, bounded padding, lossless round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_core.flat_layout import FlatLayout, Range

numels = st.lists(st.one_of(st.integers(0, 40), st.sampled_from([0, 1, 97, 1031])), max_size=8)
world_sizes = st.integers(1, 9)
alignments = st.sampled_from([1, 2, 4, 16, 128])
param_alignments = st.sampled_from([1, 1, 3, 16])


@given(numels, world_sizes, alignments)
def test_shards_are_equal_aligned_disjoint_and_cover_the_buffer_once(
    sizes: list[int], n: int, alignment: int
) -> None:
    layout = FlatLayout.of(sizes, n, alignment)
    assert layout.shard_numel % alignment == 0
    covered = [0] * layout.padded_numel
    for rank in range(n):
        shard = layout.shard_flat_range(rank)
        assert shard.size == layout.shard_numel
        for i in range(shard.start, shard.stop):
            covered[i] += 1
    assert covered == [1] * layout.padded_numel


@given(numels, world_sizes, alignments)
def test_padding_is_below_world_size_times_alignment(sizes: list[int], n: int, a: int) -> None:
    layout = FlatLayout.of(sizes, n, a)
    assert 0 <= layout.padding < n * a


@given(numels, world_sizes, alignments, param_alignments)
def test_pieces_cover_every_parameter_element_exactly_once(
    sizes: list[int], n: int, a: int, pa: int
) -> None:
    layout = FlatLayout.of(sizes, n, a, pa)
    seen = [[0] * size for size in sizes]
    for rank in range(n):
        for piece in layout.shard_pieces(rank):
            assert piece.param_range.size == piece.local_range.size == piece.flat_range.size > 0
            assert piece.flat_range.shift(rank * layout.shard_numel) == piece.local_range
            for i in range(piece.param_range.start, piece.param_range.stop):
                seen[piece.param_index][i] += 1
    assert seen == [[1] * size for size in sizes]


@given(numels, world_sizes, alignments, param_alignments, st.integers(0, 2**16))
def test_flatten_shard_gather_unflatten_is_the_identity(
    sizes: list[int], n: int, a: int, pa: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=generator) for size in sizes]
    layout = FlatLayout.of(sizes, n, a, pa)
    assert all(r.start % pa == 0 for r in layout.param_flat_ranges())
    # Each rank builds its shard from the pieces alone; concatenating shards is all_gather.
    shards = []
    for rank in range(n):
        shard = torch.zeros(layout.shard_numel)
        for piece in layout.shard_pieces(rank):
            shard[piece.local_range.start : piece.local_range.stop] = params[piece.param_index][
                piece.param_range.start : piece.param_range.stop
            ]
        shards.append(shard)
    flat = torch.cat(shards) if shards else torch.zeros(0)
    rebuilt = [flat[r.start : r.stop] for r in layout.param_flat_ranges()]
    assert all(torch.equal(x, y) for x, y in zip(params, rebuilt, strict=True))
    gaps = torch.ones(layout.padded_numel, dtype=torch.bool)
    for r in layout.param_flat_ranges():
        gaps[r.start : r.stop] = False
    assert not flat[gaps].any(), "padding must stay zero"


def test_more_ranks_than_elements_and_a_single_huge_parameter() -> None:
    tiny = FlatLayout.of([3], 8)
    assert tiny.shard_numel == 1 and tiny.padding == 5
    assert [len(tiny.shard_pieces(r)) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    huge = FlatLayout.of([10**12 + 1], 64, 128)
    assert huge.padded_numel >= 10**12 + 1 and huge.padding < 64 * 128
    assert len(huge.shard_pieces(63)) == 1


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
def test_range_intersect_and_shift(a: int, b: int, c: int, d: int) -> None:
    x, y = Range(min(a, b), max(a, b)), Range(min(c, d), max(c, d))
    overlap = x.intersect(y)
    assert set(range(overlap.start, overlap.stop)) == set(range(x.start, x.stop)) & set(
        range(y.start, y.stop)
    )
    assert x.shift(x.start) == Range(0, x.size)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1], 0), "world_size"),
        (([1], 2, 0), "alignment"),
        (([1], 2, 1, 0), "param_alignment"),
        (([-1], 2), "sizes"),
    ],
)
def test_bad_layouts_are_named(args: tuple, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        FlatLayout.of(*args)
