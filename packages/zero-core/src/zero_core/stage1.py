"""Stage 1 (P_os): optimizer states and float32 master weights partitioned; gradients not.

16 elements on N = 4 ranks (one bucket, 4 elements per shard):

    parameters (compute dtype)   every rank | p p p p p p p p p p p p p p p p |
    gradients  (compute dtype)   every rank | g g g g g g g g g g g g g g g g |  (p.grad views)
    master + optimizer states    rank 0 | m m m m |  rank 1 | m m m m |  ...  (its quarter)

After backward, each bucket of the full gradient is reduce-scattered: rank r receives the
reduced quarter it owns, steps its master quarter, and all-gathers the updated parameters.

Memory per rank (mixed precision Adam, K = 12): 2Ψ + 2Ψ + KΨ/N = 4Ψ + KΨ/N, plus the
alignment padding of the buckets; float32 Adam: 4Ψ + 4Ψ + 8Ψ/N (the master is this
rank's slice of the parameters themselves, see partitioned). With gradient accumulation
the reduced slices accumulate in a separate shard of 2Ψ/N (the full gradient buffer is
reused by every micro-step).
Communication per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ (N-1)/N, the same as stage 0.
"""

from __future__ import annotations

import torch

from .engine import restore_grad_view
from .partitioned import PartitionedEngine


class Stage1Engine(PartitionedEngine):
    _keeps_grad_views = True

    def _gradient_targets(self) -> list[list[torch.Tensor]]:
        rank = self.comm.rank
        self.grad_buckets = [
            [torch.zeros(b.layout.padded_numel, dtype=self.dtype) for b in layout.buckets]
            for layout in self.layouts
        ]
        self._grad_views: dict[int, torch.Tensor] = {}
        for params, layout, buckets in zip(
            self.groups.params, self.layouts, self.grad_buckets, strict=True
        ):
            for p, (k, flat) in zip(params, layout.param_places(), strict=True):
                self._grad_views[id(p)] = buckets[k][flat.start : flat.stop]
                p.grad = self._grad_views[id(p)].view(p.shape)
        if self.config.gradient_accumulation_steps == 1:
            # The reduced slice lands in this rank's own part of the full gradient buffer.
            return [
                [
                    grads[b.layout.shard_flat_range(rank).start :][: b.slice_numel]
                    for b, grads in zip(layout.buckets, buckets, strict=True)
                ]
                for layout, buckets in zip(self.layouts, self.grad_buckets, strict=True)
            ]
        targets = []
        for layout in self.layouts:
            shard = torch.zeros(layout.shard_numel, dtype=self.dtype)
            targets.append(
                [shard[b.local_offset : b.local_offset + b.slice_numel] for b in layout.buckets]
            )
        return targets

    def _persistent_bucket(self, group: int, bucket: int) -> torch.Tensor | None:
        return self.grad_buckets[group][bucket]

    def _collect_gradients(self) -> None:
        for _, p in self.trainable_parameters():
            restore_grad_view(p, self._grad_views[id(p)])
            self.reducer.mark_ready(p)

    def _reduce_gradients(self, first_micro_step: bool) -> None:
        super()._reduce_gradients(first_micro_step)
        if self.config.gradient_accumulation_steps > 1:
            self._zero_full_gradients()

    def _zero_full_gradients(self) -> None:
        for buckets in self.grad_buckets:
            for grads in buckets:
                grads.zero_()

    def _clear_gradients(self) -> None:
        self._zero_full_gradients()

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        held: list[torch.Tensor | None] = [g for buckets in self.grad_buckets for g in buckets]
        if self.config.gradient_accumulation_steps > 1:
            held += [slot.target for slot in self.reducer.slots]
        return held
