"""The gradient collectives of a rank that runs several micro-batch slots per micro-step.

With virtual ranks (zero_core.virtual_ranks) physical rank i runs c_i backward calls
(slots) per micro-step. Every slot's backward stages its gradients exactly as a
homogeneous rank's would and reaches the same gradient collectives, in the same canonical
order (backward_overlap.LaunchOrder), so the k-th collective of every slot reduces the
same bucket (or stage 0 chunk). :class:`SlotRows` stands where the communicator stood:

    slots 0 .. c_i-2 ("holding")  the k-th collective's input is copied into held row k
                                  and nothing is sent; the caller keeps no result
    slot c_i-1 (the last)         the k-th collective becomes reduce_scatter_rows /
                                  all_reduce_rows of (held rows of k ..., this slot's input)

Rank 0 starts the fold, so it adds its slots up as they come, ((g_0 + g_1) + g_2), which
is the fold's prefix, and sends that one row: the collective's row counts are
(1, c_1, ..., c_{N-1}). Where the gradients live in persistent full buffers (stages 0
and 1) it adds each slot's gradients straight into them (``in_place``: the components
add instead of copy in slots after the first, and nothing is held); elsewhere into one
held row. Counts (2, 1) therefore send one row per rank, and at stages 0 and 1 hold
nothing extra; counts (1, 2): rank 1 holds one copy and rank 0 sends one zero row of
padding (zero_comm.row_collectives).

Held rows are in the gradient dtype and the bucket (or flat) layout: one copy of the
bucket per extra slot (one in all on rank 0 at stages 2 and 3), from that slot's
backward to the last slot's launch; ``held_bytes`` says how many bytes that is,
``peak_bytes`` the most held.

Adding in place is exact only if every parameter's gradient of a slot arrives whole.
Where a hook lands each gradient as it comes (overlap_comm, or a wider reduce_dtype), a
second gradient in one backward (reentrant activation checkpointing) would be added to
the prefix after the first, not summed with it first, so it is refused
(``refuse_second_gradient``); without hooks autograd sums the two before they land.
"""

from __future__ import annotations

from typing import Literal

import torch

from zero_comm import Communicator, Handle
from zero_comm.handle import CompletedWork

from .config.zero_config import ZeroConfig
from .uneven_shards import FinishingHandle, UnevenShardComm
from .virtual_ranks import VirtualRanks


class SlotRows:
    """Held gradient rows of this rank's slots, and the collectives that send them."""

    def __init__(self, virtual: VirtualRanks, comm: Communicator) -> None:
        self.virtual = virtual
        self.comm = comm
        # Homogeneous counts: the plain collectives, unchanged bits and bytes.
        self.active = not virtual.homogeneous_run
        self.row_counts = (1, *virtual.counts[1:])  # rank 0 sends its pre-added block
        # Appended to every row collective's label (the same on every rank): a loop that
        # calls backward once per micro-step on every rank (the slots forgotten) meets
        # another collective there, and the mismatch error then names the setting.
        self.label_hint = (
            f" [micro_batches_per_rank={list(virtual.counts)}: rank i calls engine.backward "
            "c_i times per micro-step]"
            if self.active
            else ""
        )
        self.slot = 0
        # Rank 0 with persistent full buffers: its slots add into them (module docstring);
        # set by the gradient component that has them.
        self.in_place = False
        # Uneven shards (shard_weights): buckets split by weight, laid out as that
        # communicator lays them on the wire (N rows of the widest share) before reducing.
        self.uneven: UnevenShardComm | None = None
        self._call = 0  # the k of the next collective in this slot
        self._held: list[list[torch.Tensor]] = []  # per k: the held rows (rank 0: one sum)
        self.peak_bytes = 0

    @property
    def adding(self) -> bool:
        """Whether this slot's gradients add into the buffers instead of replacing them."""
        return self.in_place and self.slot > 0

    def refuse_second_gradient(self, name: str) -> None:
        """A parameter got a second gradient in a slot that adds in place: not exact."""
        raise RuntimeError(
            f"[rank {self.comm.rank}] parameter {name} received a second gradient in one "
            "backward (reentrant activation checkpointing does this) while this rank adds "
            "its micro-batch slots in place (micro_batches_per_rank, stages 0 and 1): use "
            "checkpoint(..., use_reentrant=False), or stage 2"
        )

    @property
    def holding(self) -> bool:
        """Whether this slot's collectives are held, not sent (every slot but the last)."""
        return self.active and self.slot < self.virtual.count - 1

    def begin_slot(self) -> None:
        """This micro-step's next slot (``slot``, 0..c-1) starts its backward."""
        self._call = 0

    def end_slot(self) -> bool:
        """The slot's backward is done; True if it was the micro-step's last (its
        reductions are done then, and the held rows are dropped)."""
        if self.slot + 1 < self.virtual.count:
            self.slot += 1
            return False
        self.clear()
        return True

    def clear(self) -> None:
        """Drop the held rows; the next backward is slot 0 (after a step, zero_grad)."""
        self._held = []
        self.slot = 0
        self._call = 0

    def calls(self, micro_steps: int) -> int:
        """Backward calls since the last step, after ``micro_steps`` whole micro-steps."""
        return micro_steps * self.virtual.count + self.slot

    def calls_per_step(self, config: ZeroConfig) -> str:
        """How many backward calls make a step, for error messages."""
        steps, slots = config.gradient_accumulation_steps, self.virtual.count
        if slots == 1:
            return f"with gradient_accumulation_steps={steps}"
        return (
            f"with gradient_accumulation_steps={steps} x {slots} micro-batches of this rank "
            f"(micro_batches_per_rank) the update applies after {steps * slots} backward calls"
        )

    @property
    def held_bytes(self) -> int:
        """Bytes of the held rows now."""
        return sum(row.numel() * row.element_size() for rows in self._held for row in rows)

    def _next(self, tensor: torch.Tensor) -> int:
        k = self._call
        self._call += 1
        if self.slot > 0 and (k >= len(self._held) or self._held[k][0].numel() != tensor.numel()):
            raise RuntimeError(
                f"[rank {self.comm.rank}] slot {self.slot} of the micro-step reached gradient "
                f"collective {k} with {tensor.numel()} elements, which slot 0 did not: every "
                "slot's backward must reach the same parameters (same model, same graph)"
            )
        return k

    def _hold(self, tensor: torch.Tensor) -> None:
        if self.in_place:
            return  # the buffers themselves hold the prefix
        k = self._next(tensor)
        flat = tensor.view(-1)
        if self.slot == 0:
            self._held.append([flat.clone()])
        elif self.virtual.rank == 0:
            self._held[k][0].add_(flat)  # the fold's prefix: ((g0 + g1) + g2) ...
        else:
            self._held[k].append(flat.clone())
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _rows(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The last slot's rows for its k-th collective (rank 0: its block, pre-added)."""
        if self.virtual.count == 1 or self.in_place:
            return [tensor.view(-1)]
        k = self._next(tensor)
        if self.virtual.rank == 0:
            return [self._held[k][0].add_(tensor.view(-1))]
        return [*self._held[k], tensor.view(-1)]

    def all_reduce(self, tensor: torch.Tensor, *, label: str) -> Handle:
        """Stage 0's chunk all-reduce, in place, asynchronous."""
        if not self.active:
            return self.comm.all_reduce(tensor, async_op=True, label=label)
        if self.holding:
            self._hold(tensor)
            return Handle(self.comm, "all_reduce", CompletedWork())
        return self.comm.all_reduce_rows(
            tensor, self._rows(tensor), self.row_counts, async_op=True,
            label=label + self.label_hint,
        )  # fmt: skip

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: Literal[True], label: str
    ) -> Handle | FinishingHandle:
        """A bucket's reduce-scatter (grad_reducer's ScatterReduction), asynchronous. When
        holding, ``output`` is not written: the reducer must not use it."""
        if not self.active:
            return self.comm.reduce_scatter(output, input, async_op=True, label=label)
        if self.holding:
            self._hold(input)
            return Handle(self.comm, "reduce_scatter", CompletedWork())
        label += self.label_hint
        if self.uneven is not None:
            return self._uneven_reduce_scatter(output, self._rows(input), label)
        return self.comm.reduce_scatter_rows(
            output, self._rows(input), self.row_counts, async_op=True, label=label
        )

    def _uneven_reduce_scatter(
        self, output: torch.Tensor, rows: list[torch.Tensor], label: str
    ) -> FinishingHandle:
        """UnevenShardComm.reduce_scatter of rows: each whole bucket laid out as N rows of
        the widest share (zeros after each share), reduced as rows, this rank's share out."""
        assert self.uneven is not None
        sizes = self.uneven.sizes(rows[0].numel())
        n, widest, dtype = len(sizes), max(sizes), rows[0].dtype
        wires = []
        for row in rows:
            wire = self.comm.buffers.take(n * widest, dtype)
            view, at = wire.view(n, widest), 0
            for r, size in enumerate(sizes):
                view[r, :size].copy_(row[at : at + size])
                view[r, size:].zero_()
                at += size
            wires.append(wire)
        mine = self.comm.buffers.take(widest, dtype)
        handle = self.comm.reduce_scatter_rows(
            mine, wires, self.row_counts, async_op=True, label=label
        )

        def finish() -> None:
            output.view(-1).copy_(mine[: output.numel()])
            for buffer in (mine, *wires):
                self.comm.buffers.give_back(buffer)

        return FinishingHandle(handle, finish)


def unsupported_with_slots(config: ZeroConfig, world_size: int) -> str | None:
    """Why ``config`` cannot run with micro_batches_per_rank, or None when it can."""
    shard = config.shard_group_size
    if shard is not None and shard != world_size:
        return (
            f"shard_group_size={shard} (hybrid sharding) is not supported with "
            "micro_batches_per_rank: use shard_group_size=None, or one micro-batch per rank"
        )
    if config.hpz_partition_size > 1:
        return (
            f"hpz_partition_size={config.hpz_partition_size} is not supported with "
            "micro_batches_per_rank: use hpz_partition_size=1"
        )
    if config.quantize_gradients:
        return (
            "quantize_gradients (qgZ) is not supported with micro_batches_per_rank: its "
            "reduction is not a fold of rows; use quantize_gradients=None"
        )
    if config.optimizer_in_backward:
        return (
            "optimizer_in_backward is not supported with micro_batches_per_rank: a bucket "
            "is reduced only in the last slot's backward; use optimizer_in_backward=False"
        )
    return None
