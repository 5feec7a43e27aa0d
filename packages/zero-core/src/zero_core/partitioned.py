"""What stages 1 and 2 share: float32 master weights and optimizer states partitioned
across ranks, gradients reduce-scattered bucket by bucket, parameters all-gathered after
the update. stage1.py and stage2.py choose where the gradients live.

Per parameter group (see group_layout): compute parameters are views into full,
padded bucket buffers (every rank holds all of them); this rank's float32 master shard
holds its slice of every bucket, one after another. With float32 parameters there is no
separate master: the master of bucket k is this rank's own slice of bucket k's parameter
buffer, a view, so the optimizer updates the parameters' storage in place and the
all-gather after the step sends each rank's slice to the others (model states 4Ψ + 4Ψ
+ 8Ψ/N at stage 1 and 4Ψ + 12Ψ/N at stage 2 for Adam, as the paper's formula with K = 8):

    bucket k, N = 4, rank 1     | r0 | r1 | r2 | r3 |   parameters (float32, full)
                                       ^^^^ rank 1's master of bucket k (the same bytes)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from zero_comm import Handle

from .engine import ZeroEngine
from .flat_layout import Range
from .grad_norm import row_sums_of_squares
from .grad_reducer import BucketReducer, BucketSlot
from .group_layout import GroupLayout, piece_numel


class PartitionedEngine(ZeroEngine):
    """Stages 1 and 2; subclasses set ``_gradient_targets``."""

    # float32 parameters: this rank's slice of each parameter bucket is its master (no
    # master tensor of its own: ``masters`` is empty, see _master_slices).
    _masters_in_buckets = False

    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        rank, size = self.comm.rank, self.comm.world_size
        self.layouts = [
            GroupLayout.build([p.numel() for p in params], size, self.config.bucket_numel)
            for params in self.groups.params
        ]
        self._masters_in_buckets = self.dtype == torch.float32
        self._masters_are_parameters = self._masters_in_buckets
        self.param_buckets: list[list[torch.Tensor]] = []
        self._param_views: dict[int, torch.Tensor] = {}
        masters: list[torch.Tensor] = []
        for params, layout in zip(self.groups.params, self.layouts, strict=True):
            buckets = [torch.zeros(b.layout.padded_numel, dtype=self.dtype) for b in layout.buckets]
            for p, (k, flat) in zip(params, layout.param_places(), strict=True):
                buckets[k][flat.start : flat.stop] = initial[id(p)].reshape(-1)
                p.data = buckets[k][flat.start : flat.stop].view(p.shape)
                self._param_views[id(p)] = p.data
            self.param_buckets.append(buckets)
            if self._masters_in_buckets:
                continue
            master = torch.zeros(layout.shard_numel)
            for p, (k, flat) in zip(params, layout.param_places(), strict=True):
                bucket = layout.buckets[k]
                mine = bucket.layout.shard_flat_range(rank)
                piece = flat.intersect(mine)
                if piece.size:
                    local = piece.shift(mine.start - bucket.local_offset)
                    values = initial[id(p)].reshape(-1)[piece.start - flat.start :]
                    master[local.start : local.stop] = values[: piece.size]
            masters.append(torch.nn.Parameter(master))
        self._build_reducer()
        return masters

    def _master_slices(self, group: int) -> list[torch.Tensor]:
        """This rank's float32 master weights of each bucket of ``group``, in bucket order
        (together: the group's master, ``_shard_pieces`` offsets): slices of the master
        tensor, or with float32 parameters views of this rank's own slice of each
        parameter bucket (writes reach the parameters; padding elements are zero)."""
        buckets = self.layouts[group].buckets
        if self._masters_in_buckets:
            rank = self.comm.rank
            return [
                full[b.layout.shard_flat_range(rank).start :][: b.slice_numel]
                for b, full in zip(buckets, self.param_buckets[group], strict=True)
            ]
        master = self.masters[group].detach()
        return [master[b.local_offset : b.local_offset + b.slice_numel] for b in buckets]

    def _master_pieces(self) -> list[list[tuple[torch.Tensor, slice]]]:
        """One optimizer tensor per bucket slice: aliases of the master slices (the
        optimizer's in-place updates land in them), so its temporaries stay within a
        bucket's slice. A group of one bucket steps its whole master, where it has one."""
        pieces: list[list[tuple[torch.Tensor, slice]]] = []
        for g, layout in enumerate(self.layouts):
            if len(layout.buckets) <= 1 and not self._masters_in_buckets:
                master = self.masters[g]
                pieces.append([(master, slice(0, master.numel()))])
                continue
            pieces.append([])
            for bucket, values in zip(layout.buckets, self._master_slices(g), strict=True):
                where = slice(bucket.local_offset, bucket.local_offset + bucket.slice_numel)
                pieces[g].append((torch.nn.Parameter(values), where))
        return pieces

    def _build_reducer(
        self, launch_order: list[int] | None = None, labels: list[str] | None = None
    ) -> None:
        """The gradient buckets, in (group, bucket) order, with this stage's targets."""
        slots = []
        targets = self._gradient_targets()
        for g, (params, layout) in enumerate(zip(self.groups.params, self.layouts, strict=True)):
            places = layout.param_places()
            for k, bucket in enumerate(layout.buckets):
                members = [(params[i], places[i][1]) for i in bucket.param_indices]
                slots.append(
                    BucketSlot(
                        bucket.layout.padded_numel,
                        bucket.slice_numel,
                        members,
                        targets[g][k],
                        self._persistent_bucket(g, k),
                    )
                )
        self.reducer = BucketReducer(
            self.comm, slots, self.dtype, self.config.max_buckets_in_flight, launch_order, labels,
            chunk_numel=self.config.bucket_numel,
        )  # fmt: skip

    # --------------------------------------------------------- stage policy hooks
    def _gradient_targets(self) -> list[list[torch.Tensor]]:
        """Per group and bucket, the tensor (slice_numel elements) that accumulates this
        rank's reduced gradient slice."""
        raise NotImplementedError

    def _persistent_bucket(self, group: int, bucket: int) -> torch.Tensor | None:
        return None

    # -------------------------------------------------------------- the step
    def _reduce_gradients(self, first_micro_step: bool) -> None:
        self.reducer.begin(first_micro_step, self.micro_step_label)
        self._collect_gradients()
        self.reducer.finish()

    def _collect_gradients(self) -> None:
        """Hand the gradients that backward left in ``p.grad`` to the reducer."""
        for _, p in self.trainable_parameters():
            self.reducer.grad_ready(p)

    def _targets(self, group: int) -> list[torch.Tensor]:
        first = sum(len(layout.buckets) for layout in self.layouts[:group])
        count = len(self.layouts[group].buckets)
        return [slot.target for slot in self.reducer.slots[first : first + count]]

    def _float32_gradients(self) -> list[torch.Tensor]:
        return [
            torch.cat([t.to(torch.float32) for t in self._targets(g)])
            if self.layouts[g].buckets
            else torch.zeros(0)
            for g in range(len(self.layouts))
        ]

    def _row_sums(self, gradients: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's BLOCK rows, gathered, then listed in parameter order (the order
        stage 0 uses) whatever the bucketing."""
        local = [row_sums_of_squares(g) for g in gradients if g.numel()]
        if not local:
            return torch.zeros(0)
        local_rows = torch.cat(local)
        everyone = torch.empty(self.comm.world_size * local_rows.numel())
        self.comm.all_gather(everyone, local_rows)
        return everyone[self._canonical_row_order()]

    def _canonical_row_order(self) -> torch.Tensor:
        order = getattr(self, "_row_order", None)
        if order is None:
            keys = [
                (group, *key)
                for rank in range(self.comm.world_size)
                for group, layout in enumerate(self.layouts)
                for key in layout.row_keys(rank)
            ]
            order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__))
            self._row_order = order
        return order

    def _param_ranges(self, group: int) -> list[tuple[torch.nn.Parameter, slice]]:
        """Pieces of this rank's shard of ``group`` that belong to each parameter."""
        layout, params = self.layouts[group], self.groups.params[group]
        ranges = []
        for bucket in layout.buckets:
            mine = bucket.layout.shard_flat_range(self.comm.rank)
            for i, flat in zip(
                bucket.param_indices, bucket.layout.param_flat_ranges(), strict=True
            ):
                piece = flat.intersect(mine)
                if piece.size:
                    local = piece.shift(mine.start - bucket.local_offset)
                    ranges.append((params[i], slice(local.start, local.stop)))
        return ranges

    def _any_rank(self, flag: bool) -> bool:
        return self.any_rank_int(flag)

    def _publish_parameters(self) -> None:
        """All-gather the updated parameters bucket by bucket, at most
        ``max_buckets_in_flight`` at once, so staging stays bounded by the config. A bucket
        larger than ``bucket_numel`` (one large parameter) goes in pieces of
        ``piece_numel`` columns, gathered into a pooled buffer and copied into place:

            full (N x S) viewed as rows:  full[r, a:b] = rank r's master[a:b]
        """
        in_flight: deque[tuple[Handle, torch.Tensor, torch.Tensor | None, torch.Tensor]] = deque()
        n = self.comm.world_size

        def finish_oldest() -> None:
            handle, staged, gathered, destination = in_flight.popleft()
            handle.wait()
            if gathered is not None:
                destination.copy_(gathered.view(destination.shape))
                self.comm.buffers.give_back(gathered)
            self.comm.buffers.give_back(staged)

        for g, (layout, buckets) in enumerate(zip(self.layouts, self.param_buckets, strict=True)):
            masters = self._master_slices(g)
            for bucket, full, master in zip(layout.buckets, buckets, masters, strict=True):
                size = bucket.slice_numel
                width = piece_numel(bucket.layout.padded_numel, self.config.bucket_numel, n)
                oversized = width < size
                for a in range(0, size, width):
                    b = min(a + width, size)
                    # Staged apart: the master may be ``full``'s own slice, and the
                    # communicator does not promise an input that aliases the output.
                    mine = self.comm.buffers.take(b - a, self.dtype)
                    mine.copy_(master[a:b])
                    if oversized:
                        gathered = self.comm.buffers.take(n * (b - a), self.dtype)
                        destination = full.view(n, size)[:, a:b]
                        handle = self.comm.all_gather(gathered, mine, async_op=True)
                    else:
                        gathered, destination = None, full
                        handle = self.comm.all_gather(full, mine, async_op=True)
                    in_flight.append((handle, mine, gathered, destination))
                    if len(in_flight) > self.config.max_buckets_in_flight:
                        finish_oldest()
        while in_flight:
            finish_oldest()
        self._check_parameter_storage()

    def _check_parameter_storage(self) -> None:
        """The parameters must still live in the buckets the all-gather writes into."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        for _, p in self.trainable_parameters():
            if p.data_ptr() != self._param_views[id(p)].data_ptr():
                raise RuntimeError(
                    f"[rank {self.comm.rank}] parameter {names.get(id(p), '?')} no longer uses "
                    "the engine's storage: its .data was replaced after initialize (for "
                    "example by module.to() or .half()), so updates would not reach it. Change "
                    "the model before zero_core.initialize"
                )

    def _shard_pieces(self, group: int) -> list[tuple[int, Range, int]]:
        pieces = []
        for bucket in self.layouts[group].buckets:
            for piece in bucket.layout.shard_pieces(self.comm.rank):
                index = bucket.param_indices[piece.param_index]
                offset = bucket.local_offset + piece.local_range.start
                pieces.append((index, piece.param_range, offset))
        return pieces

    def _write_back(self, wanted: set[int]) -> None:
        if not self._masters_in_buckets:  # else the parameters are the master already
            self._write_pieces_back(wanted, lambda g, k: self.param_buckets[g][k])

    def _write_pieces_back(
        self, wanted: set[int], full_bucket: Callable[[int, int], torch.Tensor]
    ) -> None:
        """For each wanted parameter, the part in this rank's shard: from the full bucket
        (compute dtype) into the float32 master, one parameter piece at a time."""
        rank = self.comm.rank
        for g, (params, layout) in enumerate(zip(self.groups.params, self.layouts, strict=True)):
            masters = self._master_slices(g)
            for k, (bucket, master) in enumerate(zip(layout.buckets, masters, strict=True)):
                mine = bucket.layout.shard_flat_range(rank)
                for i, flat in zip(
                    bucket.param_indices, bucket.layout.param_flat_ranges(), strict=True
                ):
                    piece = flat.intersect(mine)
                    if id(params[i]) in wanted and piece.size:
                        local = piece.shift(mine.start)
                        values = full_bucket(g, k)[piece.start : piece.stop]
                        master[local.start : local.stop] = values

    def _full_master_values(self) -> dict[int, torch.Tensor]:
        values = {}
        for g, (params, layout) in enumerate(zip(self.groups.params, self.layouts, strict=True)):
            gathered = []
            for bucket, master in zip(layout.buckets, self._master_slices(g), strict=True):
                full = torch.empty(bucket.layout.padded_numel)
                self.comm.all_gather(full, master)
                gathered.append(full)
            for p, (k, flat) in zip(params, layout.param_places(), strict=True):
                values[id(p)] = gathered[k][flat.start : flat.stop].view(p.shape)
        return values
