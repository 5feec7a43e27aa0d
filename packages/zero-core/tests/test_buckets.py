"""The bucket objects' invariants (buckets.py), over random groups, world sizes and bucket
sizes: the buckets of a group tile its flat buffers and its local shard with no gap or
overlap, every slot lies in exactly one bucket and each of its pieces within that bucket's
slice, ``overlapping`` finds exactly the buckets a local range meets, and the components'
buckets hold views of one buffer per bucket (no copies: memory does not grow)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zero_comm import Communicator, run_simulated
from zero_core.buckets import build_buckets
from zero_core.config.zero_config import ZeroConfig
from zero_core.flat_layout import Range
from zero_core.grad_norm import BLOCK
from zero_core.group_layout import GroupLayout
from zero_core.param_table import ParamTable
from zero_core.reduce_scattered_gradients import ReduceScatteredGradients
from zero_core.replicated_params import ReplicatedParameters

group_numels = st.lists(
    st.lists(st.integers(0, 300), min_size=1, max_size=6), min_size=1, max_size=3
)


@st.composite
def tables(draw: st.DrawFn) -> tuple[ParamTable, list[GroupLayout], int]:
    """A module's parameters in random groups, laid out for a random world and bucket size
    (with random fetch-unit tags, as stage 3 builds them), placed for a random rank."""
    numels = draw(group_numels)
    world_size = draw(st.integers(1, 5))
    bucket_numel = draw(st.integers(1, 1500))
    alignment = draw(st.sampled_from([1, 2, BLOCK]))
    tagged = draw(st.booleans())
    module = nn.ParameterList(
        nn.Parameter(torch.zeros(n)) for group in numels for n in group
    )  # one module, every group's parameters in order
    params = list(module.parameters())
    groups, first = [], 0
    for group in numels:
        groups.append(tuple(params[first : first + len(group)]))
        first += len(group)
    table = ParamTable(module, tuple(groups))
    layouts = []
    for group in numels:
        tags = draw(st.lists(st.integers(0, 2), min_size=len(group), max_size=len(group)))
        layouts.append(
            GroupLayout.build(group, world_size, bucket_numel, tags if tagged else None, alignment)
        )
    rank = draw(st.integers(0, world_size - 1))
    table.place(layouts, rank)
    return table, layouts, rank


@settings(max_examples=200, deadline=None)
@given(case=tables())
def test_buckets_tile_each_group_and_hold_each_slot_once(
    case: tuple[ParamTable, list[GroupLayout], int],
) -> None:
    table, layouts, rank = case
    buckets = build_buckets(layouts, table)
    assert [b.position for b in buckets] == list(range(len(buckets)))
    for g, (group, layout) in enumerate(zip(buckets.groups, layouts, strict=True)):
        assert group.group == g and group.layout is layout
        local, flat = 0, 0  # the end of the buckets so far, in the local shard and flat
        for k, bucket in enumerate(group):
            assert (bucket.group, bucket.index) == (g, k) and buckets.at(g, k) is bucket
            assert bucket.local_range == Range(local, local + bucket.slice_numel)
            assert bucket.padded_numel == layout.world_size * bucket.slice_numel
            owned = bucket.owned_range(rank)
            assert owned == Range(rank * bucket.slice_numel, (rank + 1) * bucket.slice_numel)
            local += bucket.slice_numel
            flat += bucket.padded_numel
            # its slots: disjoint flat ranges inside the bucket, each piece in its slice
            covered: list[Range] = []
            for slot in bucket.slots:
                assert buckets.of(slot) is bucket
                assert 0 <= slot.flat.start <= slot.flat.stop <= bucket.padded_numel
                assert all(slot.flat.intersect(other).size == 0 for other in covered)
                covered.append(slot.flat)
                for piece in slot.pieces:
                    assert piece.bucket == k
                    assert piece.local_range.intersect(bucket.local_range) == piece.local_range
                    assert piece.flat_range.intersect(owned) == piece.flat_range
                    assert piece.flat_range.intersect(slot.flat) == piece.flat_range
        assert local == layout.shard_numel and flat == layout.padded_numel
    in_buckets = sorted(slot.index for bucket in buckets for slot in bucket.slots)
    assert in_buckets == [slot.index for slot in table]


@settings(max_examples=200, deadline=None)
@given(case=tables(), data=st.data())
def test_overlapping_finds_exactly_the_buckets_a_local_range_meets(
    case: tuple[ParamTable, list[GroupLayout], int], data: st.DataObject
) -> None:
    table, layouts, _ = case
    buckets = build_buckets(layouts, table)
    for group in buckets.groups:
        end = group.layout.shard_numel
        start = data.draw(st.integers(0, end))
        stop = data.draw(st.integers(start, end + 5))
        wanted = Range(start, stop)
        found = list(group.overlapping(start, stop))
        expected = [
            (b, b.local_range.intersect(wanted))
            for b in group
            if b.local_range.intersect(wanted).size > 0
        ]
        assert found == expected
        # the overlaps tile the part of the range inside the shard
        assert sum(overlap.size for _, overlap in found) == wanted.intersect(Range(0, end)).size


@settings(max_examples=40, deadline=None)
@given(case=tables(), accumulate=st.booleans())
def test_component_buckets_hold_views_of_one_buffer_each(
    case: tuple[ParamTable, list[GroupLayout], int], accumulate: bool
) -> None:
    """Each slot's parameter and gradient views lie in its bucket's full buffer, each
    bucket's owned slice and reduced target are views of its full buffer (no copy), and
    the full buffers add up to the layouts' padded sizes: the bytes the paper's formulas
    count, nothing more."""
    table, layouts, rank = case
    world_size = layouts[0].world_size
    config = ZeroConfig(gradient_accumulation_steps=2 if accumulate else 1, overlap_comm=False)

    def within(view: torch.Tensor, full: torch.Tensor, where: Range) -> bool:
        start = full.data_ptr() + where.start * full.element_size()
        return view.numel() == where.size and (view.numel() == 0 or view.data_ptr() == start)

    def body(comm: Communicator) -> None:
        if comm.rank != rank:
            return
        params = ReplicatedParameters(table, layouts, torch.float32, comm, config)
        grads = ReduceScatteredGradients(
            table, layouts, torch.float32, comm, config, full_buffers=True
        )
        for components_buckets in (params.buckets, grads.buckets):
            assert [b.position for b in components_buckets] == list(range(len(components_buckets)))
        for bucket, grad_bucket in zip(params.buckets, grads.buckets, strict=True):
            full, grad_full = bucket.full_buffer, grad_bucket.full_buffer
            assert grad_full is not None
            assert full.numel() == grad_full.numel() == bucket.padded_numel
            owned = bucket.owned_range(rank)
            assert within(bucket.owned, full, owned)
            if not accumulate:  # reduced straight into this rank's part of the full buffer
                assert within(grad_bucket.target, grad_full, owned)
            else:  # a shard piece of its own, without storage until backward
                assert grad_bucket.target.untyped_storage().nbytes() == 0
            for slot in bucket.slots:
                assert slot.param_view is not None and slot.grad_view is not None
                assert within(slot.param_view.view(-1), full, slot.flat)
                assert within(slot.grad_view, grad_full, slot.flat)
        padded = sum(layout.padded_numel for layout in layouts)
        assert sum(b.full_buffer.numel() for b in params.buckets) == padded
        owned_slices = [owned for group in params.owned_slices() for owned in group]
        assert [id(owned) for owned in owned_slices] == [id(b.owned) for b in params.buckets]

    run_simulated(world_size, body)
