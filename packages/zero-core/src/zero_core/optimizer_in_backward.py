"""Stage 3 with the optimizer step fused into backward (``ZeroConfig.optimizer_in_backward``).

Plain stage 3 holds this rank's whole gradient shard from the end of backward to the step:

    backward ---------------------------------------------> step()
    grad shard     | b3 | b2 b3 | b1 b2 b3 | b0 b1 b2 b3 |   AdamW over every tile
    peak           16 bytes per parameter / N (fp32: param 4, grad 4, Adam's m and v 8)

Fused, each bucket's slice is stepped once its reduce-scatter has landed and the next
bucket's is launched (grad_reducer's _hand_over), then freed:

    backward ---------------------------------------------> step()
    grad shard     | b3 |  b2 |  b1 |  b0 |                  (only counts it)
                     ^ step b3's tiles, write them to the compute shard, free b3's slice
    peak           12 bytes per parameter / N, plus one bucket slice

The update is the one plain stage 3 applies, bit for bit: the optimizers of
optimizer_parts step tile by tile with the bits of one call, the gradient is divided by
N in place as ``Engine.step`` divides it, and nothing between the reduction and the step
reads another bucket. That holds only where nothing needs every bucket's gradient before
any is applied, so ``ZeroConfig`` refuses the settings that do:

    clip_grad_norm             the global norm needs every bucket first
    gradient_accumulation      a bucket is final only at the last micro-step
    float16                    the loss scaler must be able to skip a whole step
    nonfinite="skip"           the same: a NaN is seen after other buckets were applied
    offloaded states           their tiers step in sub-groups after backward

Why a bucket's values may change while backward runs: its reduce-scatter starts only once
every parameter in it has its gradient (grad_reducer), and a parameter's gradient is final
only after every backward node that reads the parameter has run (autograd accumulates it
last); the gathered units are copies, and a unit whose gradients are all in is never
gathered again in that backward.

A non-finite gradient: each bucket's float64 sum stays on the device, and at the end of
backward one read and one all-reduce tell every rank, which each raise FloatingPointError
naming the ranks whose slices hold it and the first such bucket's parameters. Every bucket
was already stepped (checking each before its step would stall a GPU once per bucket), so
the model is corrupt there: restore a checkpoint.

The update happens in backward, with the optimizer's options as backward began: step()
refuses options changed in between, and a step hook registered after initialize is
refused at the next backward. backward ends by publishing the parameters (the persistent
unit gathered again), so the model between backward and step() is the updated one.
"""

from __future__ import annotations

import torch

from zero_comm import Communicator, ReduceOp

from .config.zero_config import ZeroConfig
from .gradient_checks import any_model_parallel_rank
from .master_weights import MasterWeights, TileVisitor
from .model_parallel import ModelParallel
from .optimizer_parts import IN_PARTS, steps_in_parts
from .reduce_scattered_gradients import ReduceScatteredGradients


class BackwardStepper:
    """Steps this rank's master tiles bucket by bucket as backward reduces them.

    The builder wires ``bucket_reduced`` as the bucket reducer's ``on_reduced`` callback
    (its buckets are every group's buckets, group by group, in layout order)."""

    def __init__(
        self,
        comm: Communicator,
        config: ZeroConfig,
        gradients: ReduceScatteredGradients,
        masters: MasterWeights,
        optimizer: torch.optim.Optimizer,
        take_master_values: TileVisitor,
        model_parallel: ModelParallel | None = None,
    ) -> None:
        """``model_parallel``: the tensor-parallel group, told of a NaN too (its ranks hold
        other slices of the same layers)."""
        if not steps_in_parts(optimizer):
            raise ValueError(
                f"optimizer_in_backward steps the optimizer one bucket at a time, which is "
                f"exact only for torch's {', '.join(t.__name__ for t in IN_PARTS)} without "
                f"step hooks; {type(optimizer).__name__} (or its hooks) may read every tensor "
                "in one step: use one of those, or optimizer_in_backward=False"
            )
        self.comm = comm
        self.config = config
        self.gradients = gradients
        self.masters = masters
        self.optimizer = optimizer
        self.take_master_values = take_master_values
        self.model_parallel = model_parallel
        self.bucket_keys = [
            (g, k) for g, layout in enumerate(gradients.layouts) for k in range(len(layout.buckets))
        ]
        self.denominator = float(comm.world_size)
        self.options: list[dict[str, str]] = []  # each group's, when backward began
        self.landed: list[int] = []  # buckets in the order they were stepped
        self.sums: list[torch.Tensor] = []  # each one's float64 sum (on the device)

    def held_bytes(self) -> int:
        """The most gradient bytes held at once: one bucket slice (its float32 copy too,
        when the compute dtype is narrower)."""
        widest = 0
        for shard in self.gradients.grad_shards:
            for piece in shard.pieces:
                copy = 0 if piece.dtype == torch.float32 else piece.numel() * 4
                widest = max(widest, piece.numel() * piece.element_size() + copy)
        return widest

    def begin(self) -> None:
        """Before backward: the optimizer may still be stepped in parts (a step hook added
        since initialize would run once per bucket, mid-backward), and its options are
        recorded: a change made after backward would not apply (``check_options``)."""
        if not steps_in_parts(self.optimizer):
            raise ValueError(
                "optimizer_in_backward: the optimizer has step hooks now (registered after "
                "initialize); they would run once per gradient bucket, in the middle of "
                "backward. Remove them, or build the engine with optimizer_in_backward=False"
            )
        self.options = options_of(self.optimizer)
        self.landed = []
        self.sums = []

    def bucket_reduced(self, index: int) -> None:
        """Bucket ``index``'s slice holds its reduced gradient: step its tiles, hand their
        values to the compute shard and free the slice."""
        group, bucket = self.bucket_keys[index]
        piece = self.gradients.grad_shards[group].pieces[bucket]
        gradient = piece if piece.dtype == torch.float32 else piece.float()
        gradient.div_(self.denominator)
        # Summed in float64, non-finite exactly when an element is (float32 values cannot
        # overflow it); kept on the device and read once per backward (in finish), so a
        # GPU never waits for the host here.
        self.landed.append(index)
        self.sums.append(gradient.sum(dtype=torch.float64))
        self.masters.step_bucket(self.optimizer, group, bucket, gradient, self.take_master_values)
        piece.untyped_storage().resize_(0)

    def finish(self, step: int) -> None:
        """Collective, after backward: raise on every rank if any rank saw a non-finite
        gradient (naming the ranks and, where it is local, the parameters)."""
        if len(self.landed) != len(self.bucket_keys):
            raise RuntimeError(
                f"[rank {self.comm.rank}] optimizer_in_backward stepped {len(self.landed)} of "
                f"{len(self.bucket_keys)} gradient buckets in this backward"
            )
        first_here = 0  # 1 + the first non-finite bucket's index here, 0 if none
        if self.sums:
            finite = torch.stack(self.sums).isfinite().tolist()
            bad = [index for index, ok in zip(self.landed, finite, strict=True) if not ok]
            first_here = 1 + min(bad) if bad else 0
        flags = torch.zeros(self.comm.world_size, dtype=torch.int64, device=self.comm.device)
        flags[self.comm.rank] = first_here
        self.comm.all_reduce(flags, ReduceOp.SUM, label="non-finite gradients")
        seen = {rank: flag - 1 for rank, flag in enumerate(flags.tolist()) if flag}
        anywhere = bool(seen)
        if self.model_parallel is not None:
            anywhere = any_model_parallel_rank(self.model_parallel, anywhere)
        if not anywhere:
            return
        if seen:
            group, bucket = self.bucket_keys[min(seen.values())]
            members = [slot.name for slot in self.gradients.slots.in_bucket(group, bucket)]
            where = (
                f"in the reduced gradient slices held by data-parallel rank(s) {sorted(seen)} "
                "(a rank holds its slice of every rank's sum: this says where the NaN or Inf "
                f"landed, not whose data made it), first in group {group}, bucket {bucket}, "
                "whose parameters are "
                + ", ".join(members[:4])
                + (" ..." if len(members) > 4 else "")
            )
        else:
            where = "on a rank of another data-parallel group (tensor parallelism)"
        raise FloatingPointError(
            f"[rank {self.comm.rank}] non-finite gradient at step {step} {where}. With "
            "optimizer_in_backward every bucket was already applied, so the model is "
            "corrupt on those ranks: restore the last checkpoint (and lower the learning "
            "rate, or find the source of the NaN)"
        )

    def check_options(self) -> None:
        """In step(): the optimizer's options are those backward applied the update with."""
        now = options_of(self.optimizer)
        if now == self.options:
            return
        changed = [
            f"group {g}: {key} {before.get(key)} -> {after.get(key)}"
            for g, (before, after) in enumerate(zip(self.options, now, strict=False))
            for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)
        ]
        raise RuntimeError(
            f"[rank {self.comm.rank}] the optimizer's options changed between backward and "
            f"step() ({'; '.join(changed) or 'its groups'}): with optimizer_in_backward the "
            "update was applied during backward, with the old values. Change them before "
            "backward (a scheduler stepped after engine.step() does)"
        )


def options_of(optimizer: torch.optim.Optimizer) -> list[dict[str, str]]:
    """Each group's options but its tensors, as text (a tensor learning rate too)."""
    return [
        {key: repr(value) for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
