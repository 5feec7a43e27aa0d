"""Gradients reduce-scattered bucket by bucket (stages 1-3): each rank keeps its slice.

Two placements of the gradient before it is reduced:

    full buffers (stage 1)   every rank | g g g g g g g g g g g g g g g g |  p.grad views;
                             a hook marks each gradient ready as autograd accumulates it
                             and complete buckets are reduced during backward (after it,
                             with overlap_comm=False); rank r's slice lands in its target
    sharded (stages 2, 3)    a hook moves each gradient into a pooled staging bucket as
                             soon as autograd has it, and frees it; complete buckets are
                             reduced during backward (grad_reducer)

    target (rank r)          | slice of bucket 0 | slice of bucket 1 | ...   gradient dtype

Buffers, staging and targets are in ``config.gradient_dtype``: the compute dtype, or
float32 with ``reduce_dtype`` (each compute-dtype gradient is cast as it is copied in).
Full buffers in a wider dtype than the parameters cannot be ``.grad`` views: a hook casts
each gradient into its place and drops ``.grad`` (allreduced_gradients.land_in_buffer;
hooked also with ``overlap_comm=False``, launching nothing until after backward).

The target is the gradient shard (sharded), this rank's own slice of the full buffer
(full buffers, no accumulation), or a shard of its own (full buffers, accumulation). A
shard is a ShardGradient: one tensor per bucket slice, given storage when its bucket's
first reduced slice lands and freed after the step (shard_gradient.py), so no gradient
shard is held between steps.

Hybrid sharding with a native communicator and accumulation: buckets are reduced inside
the shard group only, and ``float32_gradients`` (the boundary) first all-reduces each
accumulated shard across the replicas, in pieces of at most ``bucket_numel``.

Gradient offload (``config.gradients_offloaded``, sharded placement): the slices of the
buckets whose master tiles are all in host memory or on disk leave the device as they
land (offload.gradient_tier) and are *away* pieces of the shard. Not for full buffers
(stage 1): its full gradient buckets stay on the device whatever happens to the reduced
slice, so moving the slice would save at most 1/N of what the device holds for
gradients; nor with hybrid sharding's boundary sum across replicas (it all-reduces the
accumulated shard on the device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from zero_comm import Communicator, ReduceOp

from .allreduced_gradients import drop_grad_views, land_in_buffer, restore_grad_view
from .backward_overlap import register_gradient_hooks
from .buckets import Bucket, BucketTable, build_buckets
from .config.zero_config import ZeroConfig
from .grad_norm import BLOCK, row_sums_of_squares
from .grad_reducer import BucketReducer, GradBucket, ScatterReduction
from .group_layout import GroupLayout
from .memory.report import tensor_bytes
from .offload.gradient_tier import GradientTier
from .offload.masters import OffloadedMasters
from .param_table import ParamSlot, ParamTable
from .reduced_gradient import GroupGradient, ShardGradient, unallocated
from .slot_rows import SlotRows
from .uneven_shards import gather_counts


class ReduceScatteredGradients:
    """This rank's reduced gradient slices, from full buffers or from hooks."""

    def __init__(
        self,
        slots: ParamTable,
        layouts: list[GroupLayout],
        dtype: torch.dtype,
        comm: Communicator,
        config: ZeroConfig,
        *,
        full_buffers: bool,
        reduce_order: tuple[list[int], list[str]] | None = None,
        reduction: ScatterReduction | None = None,
        across_replicas: Communicator | None = None,
        offloaded_masters: OffloadedMasters | None = None,
        slot_rows: SlotRows | None = None,
    ) -> None:
        """``offloaded_masters``: the masters' tiers, which the gradients follow where
        ``config.gradients_offloaded`` (module docstring); ``slot_rows``: several
        micro-batch slots per rank (grad_reducer; zero_core.slot_rows)."""
        self.slots = slots
        self.layouts = layouts
        self.dtype = dtype
        self.comm = comm
        self.config = config
        self.full_buffers = full_buffers
        # p.grad views the full buffers unless they are wider than the parameters.
        self.grads_are_views = full_buffers and dtype == config.param_dtype
        self.accumulating = config.gradient_accumulation_steps > 1
        # Hybrid, native, accumulating: the replicas are summed once, at the boundary.
        self.across_replicas = across_replicas
        if across_replicas is not None and not self.accumulating:
            raise ValueError("across_replicas needs gradient accumulation (it sums shards)")
        self.buckets: BucketTable[GradBucket] = build_buckets(layouts, slots).map(self._bucket)
        # Sharded, or full buffers with accumulation: per group, this rank's gradient shard,
        # one piece per bucket: the buckets' targets.
        self.grad_shards: list[ShardGradient] = []
        if not full_buffers or self.accumulating:
            self.grad_shards = [
                ShardGradient(
                    [b.target for b in group],
                    [b.local_offset for b in group],
                    device_type=comm.device.type,
                )
                for group in self.buckets.groups
            ]
        self.tier: GradientTier | None = None
        if (
            config.gradients_offloaded
            and offloaded_masters is not None
            and not full_buffers
            and across_replicas is None
        ):
            self.tier = GradientTier(
                list(self.buckets), self.grad_shards, offloaded_masters, dtype, comm.device,
                config.offload_pin_memory,
            )  # fmt: skip
        launch_order, labels = reduce_order or (None, None)
        # Full buffers can wait for the end of backward (a reentrant checkpoint's second
        # gradient then adds in place); sharded gradients cannot, they are freed as they come.
        overlap = config.overlap_comm or not full_buffers
        remedy = "use checkpoint(..., use_reentrant=False)" + (
            ", or overlap_comm=False"
            if full_buffers
            else ", or stage 0 or 1 with overlap_comm=False"
        )
        if slot_rows is not None and full_buffers and comm.rank == 0:
            slot_rows.in_place = True  # rank 0 adds its slots into the full buffers
        self.slot_rows = slot_rows
        # Uneven shards (zero_core.uneven_shards) move every bucket whole and by itself.
        uneven = any(layout.uneven for layout in layouts)
        self.reducer = BucketReducer(
            comm, list(self.buckets), dtype, config.max_buckets_in_flight, launch_order, labels,
            chunk_numel=None if uneven else config.bucket_numel, overlap=overlap,
            remedy=remedy, reduction=reduction,
            coalesce_numel=0 if uneven else config.coalesce_limit, slot_rows=slot_rows,
        )  # fmt: skip
        if self.tier is not None and not self.tier.homes:
            self.tier = None  # every tile on the device (offload_fraction 0): nothing leaves
        if self.tier is not None:
            self.tier.reduced_together(self.reducer.groups)
            self.reducer.on_reduced = self.tier.landed  # each bucket, as it lands
        # Called with each slot whose gradient a hook handed over (stage 3 frees units).
        self.gradient_listeners: list[Callable[[ParamSlot], None]] = []
        self._accepting = False  # inside engine.backward: hooks hand gradients over
        # Full buffers wider than the parameters take each gradient as it lands, overlapped
        # or not (the cast must happen before autograd would add a second gradient in place).
        self._hooked = overlap or (full_buffers and not self.grads_are_views)
        self._hooks: list[Any] = (
            register_gradient_hooks(self, slots, ReduceScatteredGradients._on_gradient)
            if self._hooked
            else []
        )

    def _bucket(self, bucket: Bucket) -> GradBucket:
        """``bucket`` with its target and, for full buffers, its full gradient buffer (zeros;
        its slots' ``grad_view`` are views of it). The target is this rank's part of the
        full buffer (full buffers, no accumulation), else a shard piece of its own that
        has no storage until its first reduced slice lands (reduced_gradient)."""
        full = None
        if self.full_buffers:
            full = torch.zeros(bucket.padded_numel, dtype=self.dtype, device=self.comm.device)
            for slot in bucket.slots:
                slot.grad_view = full[slot.flat.start : slot.flat.stop]
        if full is not None and not self.accumulating:
            target = full[bucket.owned_range(self.comm.rank).start :][: bucket.slice_numel]
        else:
            target = unallocated(bucket.slice_numel, self.dtype, self.comm.device)
        return GradBucket(*bucket.base(), target=target, full_buffer=full)

    def _on_gradient(self, slot: ParamSlot) -> None:
        """Hook: hand ``slot``'s gradient over (full buffers: it is in its view already,
        restored there if the user replaced ``.grad``, or cast into its place in a wider
        buffer; sharded: moved into its bucket)."""
        if self._accepting:
            if self.full_buffers:
                self._full_buffer_ready(slot)
            else:
                self.reducer.grad_ready(slot)
            for listener in self.gradient_listeners:
                listener(slot)

    # -------------------------------------------------------------- the step
    def before_backward(self, first_micro_step: bool, label: str) -> None:
        if self.tier is not None:
            self.tier.first = first_micro_step
        self.reducer.begin(first_micro_step, label)
        self._accepting = self._hooked

    def after_backward(self, first_micro_step: bool) -> None:
        """Reduce what backward left (parameters without a gradient are zeros) and wait
        for it all."""
        if self.full_buffers:
            for slot in self.slots:
                if not self.reducer.has_gradient(slot):
                    self._full_buffer_ready(slot)
        self.reducer.finish()
        if self.tier is not None:
            self.tier.drain()  # the disk slices' writes behind the backward
        holding = self.slot_rows is not None and self.slot_rows.holding
        if self.full_buffers and self.accumulating and not holding:
            self._zero_full_buffers()  # (a held slot's are its prefix, or overwritten)

    def _full_buffer_ready(self, slot: ParamSlot) -> None:
        """``slot``'s gradient is in its view of the full buffer (restored there if the
        user replaced ``.grad``), or cast into its place in a wider one; in a micro-batch
        slot that adds in place (slot_rows) added there instead."""
        adding = self.slot_rows is not None and self.slot_rows.adding

        def land(again: bool) -> None:
            if again and adding:
                assert self.slot_rows is not None
                self.slot_rows.refuse_second_gradient(slot.name)
            if not self.grads_are_views:
                land_in_buffer(slot, again or adding)

        if self.grads_are_views:
            restore_grad_view(slot, add=adding)
        self.reducer.mark_ready(slot, land=land)

    def end_backward(self) -> None:
        self._accepting = False
        if self.tier is not None:  # also after a backward that raised
            self.tier.drain(raise_errors=False)

    def _zero_full_buffers(self) -> None:
        for bucket in self.buckets:
            if bucket.full_buffer is not None:
                bucket.full_buffer.zero_()

    def float32_gradients(self) -> list[GroupGradient]:
        """Per group, this rank's accumulated gradient slice in float32: the shard itself
        when it is float32 (step() scales it in place and clears it after), else a copy.

        Collective with ``across_replicas``: it first sums the accumulated shards over the
        replicas, so it is called once per accumulation boundary (by ``step()``)."""
        for shard in self.grad_shards:
            shard.materialize_zeros()
        if self.across_replicas is not None:
            self._sum_across_replicas()
        if self.grad_shards and not self.full_buffers:
            return [shard.for_step().float() for shard in self.grad_shards]
        # Full buffers without accumulation: the reduced slices are views of this rank's
        # part of each bucket, handed over as they are (a float32 step scales them in
        # place; clear() zeroes the buffers after it). Concatenating them into one flat
        # tensor copied the whole slice every step: 129 of stage 1's 209 ms at 19M, N = 2.
        gradients: list[GroupGradient] = []
        for group in self.buckets.groups:
            targets = [bucket.target for bucket in group]
            offsets = [bucket.local_offset for bucket in group]
            gradients.append(
                ShardGradient(targets, offsets).float()
                if targets
                else torch.zeros(0, device=self.comm.device)
            )
        return gradients

    def _sum_across_replicas(self) -> None:
        assert self.across_replicas is not None
        piece = self.config.bucket_numel
        for shard in self.grad_shards:
            for bucket_slice in shard.pieces:
                for start in range(0, bucket_slice.numel(), piece):
                    self.across_replicas.all_reduce(
                        bucket_slice[start : start + piece], label="gradients across replicas"
                    )

    def row_sums(self, gradients: list[GroupGradient]) -> torch.Tensor:
        """Every rank's BLOCK rows, gathered, then listed in parameter order (the order
        stage 0 uses) whatever the bucketing (a bucket slice is whole BLOCK rows)."""
        local = [row_sums_of_squares(p) for p in self._row_pieces(gradients) if p.numel()]
        if not local:
            return torch.zeros(0, device=self.comm.device)
        local_rows = torch.cat(local)
        counts = [
            sum(layout.shard_numel_of(r) for layout in self.layouts) // BLOCK
            for r in range(self.comm.world_size)
        ]
        everyone = gather_counts(self.comm, local_rows, counts)
        return everyone[self._canonical_row_order()]

    def _row_pieces(self, gradients: list[GroupGradient]) -> Iterator[torch.Tensor]:
        """Every bucket slice of ``gradients`` on the device, in order: an away slice is
        read back and copied to the device, one at a time, so its rows are summed by the
        device's kernel as its resident twin's would be (and so is a host piece of a
        clone, model_parallel_rows'). A generator: the caller keeps only each slice's row
        sums, so the device holds one away slice at a time, not the whole shard."""
        for g in gradients:
            if not isinstance(g, ShardGradient):
                yield g.to(self.comm.device)
                continue
            for k, piece in enumerate(g.pieces):
                values = g.away_values(k) if k in g.away else piece
                yield values.to(self.comm.device)

    def _canonical_row_order(self) -> torch.Tensor:
        order = getattr(self, "_row_order", None)
        if order is None:
            keys = [
                (group, *key)
                for rank in range(self.comm.world_size)
                for group, layout in enumerate(self.layouts)
                for key in layout.row_keys(rank)
            ]
            order = torch.tensor(
                sorted(range(len(keys)), key=keys.__getitem__), device=self.comm.device
            )
            self._row_order = order
        return order

    def any_rank(self, flag: bool) -> bool:
        token = torch.tensor([int(flag)], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(token, ReduceOp.MAX)
        return bool(token.item())

    def clear(self) -> None:
        # The next backward rewrites every view (or casts into it): nothing to zero.
        if self.grads_are_views:
            drop_grad_views(self.slots)
        for shard in self.grad_shards:
            shard.release()
        if self.tier is not None:
            self.tier.release()

    def tensors(self) -> list[torch.Tensor]:
        """The gradient tensors (a shard's pieces have storage only from backward to step)."""
        held = [b.full_buffer for b in self.buckets if b.full_buffer is not None]
        for shard in self.grad_shards:
            held += shard.pieces
        return held

    def step_bytes(self) -> int:
        """Device bytes the gradients take from backward to the step (the paper's gradient
        term: the shards count whole, held or not now; offloaded slices only by the most
        of them landed at once, ``GradientTier.landed_bytes``)."""
        full = tensor_bytes(b.full_buffer for b in self.buckets if b.full_buffer is not None)
        landed = 0 if self.tier is None else self.tier.landed_bytes
        return full + sum(shard.nbytes() for shard in self.grad_shards) + landed

    @property
    def host_bytes(self) -> int:
        """Host bytes of offloaded gradient slices (disk tiles' blocks are swap files)."""
        return 0 if self.tier is None else self.tier.host_bytes

    def in_flight_bytes(self) -> int:
        """The device bound of the offloaded gradients (``GradientTier.in_flight_bytes``
        over ``max_buckets_in_flight``); 0 when none are offloaded."""
        if self.tier is None:
            return 0
        return self.tier.in_flight_bytes(self.config.max_buckets_in_flight)
