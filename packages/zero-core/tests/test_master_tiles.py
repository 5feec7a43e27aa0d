"""Master tiles cut below a bucket slice (master_weights.CPU_TILE_NUMEL, the CPU's cache
-sized optimizer tensors) change no bit of any stage, and every tile stays within one
bucket slice and within the limit.

The limit is patched around ``run_simulated``, never inside a rank's body: the ranks are
threads, and patches entered and left by several threads at once can restore each
other's value and leave the module patched for every later test."""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParityCase, assert_same_states, build_engine, parity_cases, train

from zero_comm import Communicator, run_simulated
from zero_core import master_weights

STAGES = (0, 1, 2, 3)


@settings(max_examples=10, deadline=None)
@given(
    case=parity_cases(),
    world_size=st.sampled_from([1, 2, 3]),
    tile_numel=st.sampled_from([2, 7, 64]),
)
def test_cut_tiles_equal_whole_bucket_slices_at_every_stage(
    case: ParityCase, world_size: int, tile_numel: int
) -> None:
    """Stage 0 with a tile per bucket slice is the reference; stages 0-3 with tiles of at
    most ``tile_numel`` elements equal it after every step."""
    with mock.patch.object(master_weights, "CPU_TILE_NUMEL", 2**40):
        reference = run_simulated(world_size, lambda comm: train(case, comm, 0))
    with mock.patch.object(master_weights, "CPU_TILE_NUMEL", tile_numel):
        cut = run_simulated(world_size, lambda comm: [train(case, comm, s) for s in STAGES])
    for rank, (expected, per_stage) in enumerate(zip(reference, cut, strict=True)):
        for stage, got in zip(STAGES, per_stage, strict=True):
            assert_same_states(expected, got, f"rank {rank}, stage {stage}")
    assert master_weights.CPU_TILE_NUMEL == 2**18  # the patches are gone


@settings(max_examples=10, deadline=None)
@given(case=parity_cases(), stage=st.sampled_from(STAGES), tile_numel=st.integers(1, 50))
def test_tiles_cover_each_bucket_slice_within_the_limit(
    case: ParityCase, stage: int, tile_numel: int
) -> None:
    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, stage)
        masters: Any = engine.masters
        for group, tiles in zip(masters.buckets.groups, masters.tiles, strict=True):
            if len(group):  # each tile is listed by its bucket, in order
                listed = [tile for bucket in group for tile, _ in bucket.tiles]
                assert [id(t) for t in listed] == [id(tile) for tile, _ in tiles]
            covered = 0
            for bucket in group:
                assert bucket.tiles, "every bucket slice has a tile"
                end = bucket.local_offset + bucket.slice_numel
                for tile, where in bucket.tiles:
                    assert bucket.local_offset <= where.start and where.stop <= end
                    assert tile.numel() == where.stop - where.start <= tile_numel
                    assert where.start == covered or tile.numel() == 0
                    covered = where.stop
            assert covered == group.layout.shard_numel
        engine.close()

    with mock.patch.object(master_weights, "CPU_TILE_NUMEL", tile_numel):
        run_simulated(2, body)
