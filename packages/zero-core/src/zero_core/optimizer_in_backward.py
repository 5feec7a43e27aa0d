"""Stage 3 with the optimizer step fused into backward (``ZeroConfig.optimizer_in_backward``).

Plain stage 3 holds this rank's whole gradient shard from the end of backward to the step:

    backward ---------------------------------------------> step()
    grad shard     | b3 | b2 b3 | b1 b2 b3 | b0 b1 b2 b3 |   AdamW over every tile
    peak           16 bytes per parameter / N (fp32: param 4, grad 4, Adam's m and v 8)

Fused, each bucket's slice is stepped the moment its reduce-scatter lands, then freed:

    backward ---------------------------------------------> step()
    grad shard     | b3 |  b2 |  b1 |  b0 |                  (only publishes and counts)
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

A non-finite gradient: the rank that sees it leaves that bucket's tiles unstepped; at the
end of backward one all-reduce tells every rank, and each raises FloatingPointError. The
other buckets were already stepped, so the model is part-updated: restore a checkpoint.
"""

from __future__ import annotations

import torch

from zero_comm import Communicator, ReduceOp

from .config import ZeroConfig
from .gradient_checks import all_finite, any_model_parallel_rank
from .master_weights import MasterWeights, TileVisitor
from .model_parallel import ModelParallel
from .optimizer_parts import steps_in_parts
from .reduce_scattered_gradients import ReduceScatteredGradients


class BackwardStepper:
    """Steps this rank's master tiles bucket by bucket as backward reduces them.

    Wired as the bucket reducer's ``on_reduced`` callback (its buckets are every group's
    buckets, group by group, in layout order)."""

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
                f"exact only for torch's {', '.join(('SGD', 'Adam', 'AdamW', 'Adagrad'))} and "
                f"RMSprop without step hooks; {type(optimizer).__name__} (or its hooks) may "
                "read every tensor in one step: use one of those, or "
                "optimizer_in_backward=False"
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
        self.nonfinite: list[tuple[int, int]] = []  # (group, bucket) left unstepped here
        self.stepped = 0
        gradients.reducer.on_reduced = self.bucket_reduced

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
        self.nonfinite = []
        self.stepped = 0

    def bucket_reduced(self, index: int) -> None:
        """Bucket ``index``'s slice holds its reduced gradient: step its tiles, hand their
        values to the compute shard and free the slice."""
        group, bucket = self.bucket_keys[index]
        piece = self.gradients.grad_shards[group].pieces[bucket]
        gradient = piece if piece.dtype == torch.float32 else piece.float()
        gradient.div_(self.denominator)
        if all_finite([gradient], self.config.bucket_numel):
            self.masters.step_bucket(
                self.optimizer, group, bucket, gradient, self.take_master_values
            )
        else:
            self.nonfinite.append((group, bucket))
        self.stepped += 1
        piece.untyped_storage().resize_(0)

    def finish(self, step: int) -> None:
        """Collective, after backward: raise on every rank if any rank saw a non-finite
        gradient (naming the ranks and, where it is local, the parameters)."""
        if self.stepped != len(self.bucket_keys):
            raise RuntimeError(
                f"[rank {self.comm.rank}] optimizer_in_backward stepped {self.stepped} of "
                f"{len(self.bucket_keys)} gradient buckets in this backward"
            )
        flags = torch.zeros(self.comm.world_size, dtype=torch.int32, device=self.comm.device)
        flags[self.comm.rank] = int(bool(self.nonfinite))
        self.comm.all_reduce(flags, ReduceOp.SUM, label="non-finite gradients")
        ranks = [r for r, flag in enumerate(flags.tolist()) if flag]
        anywhere = bool(ranks)
        if self.model_parallel is not None:
            anywhere = any_model_parallel_rank(self.model_parallel, anywhere)
        if not anywhere:
            return
        here = ""
        if self.nonfinite:
            group, bucket = self.nonfinite[0]
            members = [slot.name for slot in self.gradients.slots.in_bucket(group, bucket)]
            here = (
                f"; here in group {group}, bucket {bucket}, whose parameters are "
                + ", ".join(members[:4])
                + (" ..." if len(members) > 4 else "")
            )
        where = ranks or "(none; a rank of another model-parallel group)"
        raise FloatingPointError(
            f"[rank {self.comm.rank}] non-finite gradient at step {step} on data-parallel "
            f"rank(s) {where}{here}. With optimizer_in_backward the buckets reduced before "
            "it were already applied, so the model is part-updated: restore the last checkpoint "
            "(and lower the learning rate, or find the source of the NaN)"
        )
