"""Memory-weighted uneven shards (issue 52): rank r holds a share of every sharded model
state proportional to ``ZeroConfig.shard_weights[r]``, with the bits of even shards.

Where the shares come from. Each bucket (group_layout) is split by flat_layout's
``weighted_units``: its elements, in BLOCK (128-element) units, one unit per rank first
and the rest in proportion to the weights. Parameters stay end to end in the bucket;
only the boundaries between ranks move, and they stay on BLOCK rows, so the gradient
norm's rows (grad_norm) never straddle two ranks. Weights 2, 1 on a bucket of 12 rows:

    bucket rows   0 1 2 3 4 5 6 7 | 8 9 10 11        rank 0: 8 rows, rank 1: 4 rows

How they move (the "padded slices" design). The collectives of zero_comm move N equal
chunks; this module's :class:`UnevenShardComm` puts each rank's slice at the start of
a chunk of S = the largest share, zero padding after it, on the wire:

    reduce_scatter the bucket is copied into N x S rows, row r = [ slice_r | 0 .. ];
                   rank r keeps the first s_r elements of its reduced row
    all_gather     each rank copies its slice into its place in the bucket, then
                   rank r's place is broadcast from rank r, r = 0 .. N-1 (N broadcasts,
                   no buffer: stage 3 keeps several gathers in flight, and N x S
                   buffers for each cost 10% of a rank's budget in fit_uneven)

An element is reduced by the same collective in the same rank order as with even shards,
and the optimizer step and the gradient norm are elementwise or row-wise, so every bit is
unchanged. The cost: a reduction's wire carries N x S elements instead of sum(s) (the
communicator's stats count the wire, so they show it: 4/3 of the even volume for weights
2, 1) and copies the bucket into its wire buffer; a gather is N broadcasts instead of one
all-gather (N latencies; the stats count broadcasts, sum(s) elements in all). The
persistent states (masters, optimizer states, gradient shard, stage 3's parameter shard)
hold only s_r elements.

What this gives up (refused or turned off by name): hybrid sharding, hpZ, qwZ, qgZ and the
hierarchical gather (config.shard_weights_rule), coalesced reductions and gathers, and
the piecewise reduction of oversized buckets (every bucket moves whole: its wire buffer is
N x S of that bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero_comm import Communicator

from .config.shard_weights_rule import check_world
from .flat_layout import weighted_units
from .grad_norm import BLOCK


class FinishingHandle:
    """An asynchronous uneven collective: the last collective's handle, and what
    completes the whole (the copy out of a reduction's wire buffer, or the waits of a
    gather's other broadcasts), run once, at the first ``wait()``."""

    def __init__(self, handle: Any, finish: Callable[[], None]) -> None:
        self._handle = handle
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        self._handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class UnevenShardComm:
    """The data-parallel communicator of a run with uneven shards: ``all_gather`` and
    ``reduce_scatter`` take a whole bucket (``sum(s)`` elements) and this rank's slice
    (``s_rank`` elements), where the split of the bucket is the weighted split of its
    size (flat_layout.weighted_units over BLOCK units); ``all_gather_v`` takes explicit
    sizes. Every other attribute is the wrapped communicator's."""

    def __init__(self, comm: Communicator, weights: Sequence[float], alignment: int = BLOCK):
        if len(weights) != comm.world_size:
            raise ValueError(
                f"[rank {comm.rank}] {len(weights)} shard weights for {comm.world_size} ranks"
            )
        self.comm = comm
        self.weights = tuple(weights)
        self.alignment = alignment

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def sizes(self, numel: int) -> tuple[int, ...]:
        """Each rank's slice of a bucket of ``numel`` elements (padding included)."""
        units, rest = divmod(numel, self.alignment)
        if rest or units < len(self.weights):
            raise ValueError(
                f"[rank {self.comm.rank}] a bucket of {numel} elements is not a weighted "
                f"layout's (whole {self.alignment}-element units, at least one per rank)"
            )
        return tuple(u * self.alignment for u in weighted_units(units, self.weights))

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, label: str = ""
    ) -> FinishingHandle | None:
        """``output`` (a whole bucket) = every rank's slice, in rank order."""
        return self.all_gather_v(
            output, input, self.sizes(output.numel()), async_op=async_op, label=label
        )

    def all_gather_v(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        sizes: Sequence[int],
        *,
        async_op: bool = False,
        label: str = "",
    ) -> FinishingHandle | None:
        """``output`` = the concatenation of every rank's ``input``, of ``sizes[r]``
        elements on rank r (``sum(sizes)`` in all): this rank's slice is copied into its
        place, then rank r's place is broadcast from rank r, for every r. No buffer
        beyond ``output``: an equal all-gather of padded chunks would hold N x max(sizes)
        more per gather in flight, and stage 3 keeps several in flight (its prefetch),
        which cost 40 MiB of a 400 MiB budget in tools/hetero/fit_uneven.py."""
        comm = self.comm
        self._check(output, input, sizes, "all_gather")
        out, at = output.view(-1), 0
        handles = []
        for r, size in enumerate(sizes):
            place = out[at : at + size]
            if r == comm.rank:
                place.copy_(input.reshape(-1))
            handles.append(comm.broadcast(place, r, async_op=True, label=label))
            at += size

        def finish() -> None:
            for handle in handles[:-1]:
                handle.wait()

        return _complete(handles[-1], finish, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = None,
        *,
        async_op: bool = False,
        label: str = "",
    ) -> FinishingHandle | None:
        """``output`` (this rank's slice) = the rank-ordered reduction of its slice of
        every rank's ``input`` (a whole bucket)."""
        comm, n = self.comm, self.comm.world_size
        sizes = self.sizes(input.numel())
        self._check(input, output, sizes, "reduce_scatter")
        widest = max(sizes)
        wire = comm.buffers.take(n * widest, input.dtype)
        rows, flat, at = wire.view(n, widest), input.reshape(-1), 0
        for r, size in enumerate(sizes):
            rows[r, :size].copy_(flat[at : at + size])
            rows[r, size:].zero_()
            at += size
        mine = comm.buffers.take(widest, input.dtype)
        if op is None:
            handle = comm.reduce_scatter(mine, wire, async_op=True, label=label)
        else:
            handle = comm.reduce_scatter(mine, wire, op, async_op=True, label=label)

        def finish() -> None:
            output.view(-1).copy_(mine[: output.numel()])
            comm.buffers.give_back(mine)
            comm.buffers.give_back(wire)

        return _complete(handle, finish, async_op)

    def _check(
        self, whole: torch.Tensor, part: torch.Tensor, sizes: Sequence[int], what: str
    ) -> None:
        rank = self.comm.rank
        if len(sizes) != self.comm.world_size or whole.numel() != sum(sizes):
            raise ValueError(
                f"[rank {rank}] uneven {what}: {whole.numel()} elements do not split into "
                f"{list(sizes)}"
            )
        if part.numel() != sizes[rank]:
            raise ValueError(
                f"[rank {rank}] uneven {what}: this rank's slice has {part.numel()} elements, "
                f"its share of the bucket is {sizes[rank]}"
            )


def _complete(handle: Any, finish: Callable[[], None], async_op: bool) -> FinishingHandle | None:
    done = FinishingHandle(handle, finish)
    if async_op:
        return done
    done.wait()
    return None


def uneven_weights(config: Any, comm: Communicator) -> tuple[float, ...] | None:
    """``config.shard_weights`` checked against the data-parallel world ``comm`` (one
    weight per rank, resolved), or None for even shards."""
    check_world(config.shard_weights, comm.world_size)
    weights: tuple[float, ...] | None = config.shard_weights
    return weights


def gather_counts(
    comm: Communicator | UnevenShardComm, local: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """Every rank's ``local`` (``counts[r]`` elements on rank r), concatenated in rank
    order: uneven through an UnevenShardComm, else an equal all-gather."""
    everyone = local.new_empty(sum(counts))
    if isinstance(comm, UnevenShardComm):  # its all_gather splits a bucket by the weights
        comm.all_gather_v(everyone, local, counts)
    else:
        comm.all_gather(everyone, local)
    return everyone
