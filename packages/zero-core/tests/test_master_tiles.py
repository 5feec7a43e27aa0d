"""Master tiles cut below a bucket slice (master_weights.CPU_TILE_NUMEL, the CPU's cache
-sized optimizer tensors) change no bit of any stage, and every tile stays within one
bucket slice and within the limit."""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from parity import ParityCase, assert_same_states, build_engine, parity_cases, train

from zero_comm import Communicator, run_simulated
from zero_core import master_weights


@settings(max_examples=12, deadline=None)
@given(
    case=parity_cases(),
    world_size=st.sampled_from([1, 2, 3]),
    tile_numel=st.sampled_from([1, 3, 7, 64]),
)
def test_cut_tiles_equal_whole_bucket_slices_at_every_stage(
    case: ParityCase, world_size: int, tile_numel: int
) -> None:
    """Stage 0 with a tile per bucket slice is the reference; stages 0-3 with tiles of at
    most ``tile_numel`` elements equal it after every step."""

    def body(comm: Communicator) -> None:
        with mock.patch.object(master_weights, "CPU_TILE_NUMEL", 2**40):
            reference = train(case, comm, 0)
        with mock.patch.object(master_weights, "CPU_TILE_NUMEL", tile_numel):
            for stage in (0, 1, 2, 3):
                assert_same_states(reference, train(case, comm, stage), f"stage {stage}")

    run_simulated(world_size, body)


@settings(max_examples=10, deadline=None)
@given(case=parity_cases(), stage=st.sampled_from([0, 1, 2, 3]), tile_numel=st.integers(1, 50))
def test_tiles_cover_each_bucket_slice_within_the_limit(
    case: ParityCase, stage: int, tile_numel: int
) -> None:
    def body(comm: Communicator) -> None:
        with mock.patch.object(master_weights, "CPU_TILE_NUMEL", tile_numel):
            engine = build_engine(case, comm, stage)
        masters: Any = engine.masters
        for group, (tiles, buckets) in enumerate(
            zip(masters.tiles, masters.tile_buckets, strict=True)
        ):
            layout = masters.layouts[group]
            covered = 0
            for (tile, where), bucket in zip(tiles, buckets, strict=True):
                b = layout.buckets[bucket]
                end = b.local_offset + b.slice_numel
                assert b.local_offset <= where.start and where.stop <= end
                assert tile.numel() == where.stop - where.start <= tile_numel
                assert where.start == covered or tile.numel() == 0
                covered = where.stop
            assert covered == layout.shard_numel
        engine.close()

    run_simulated(2, body)
