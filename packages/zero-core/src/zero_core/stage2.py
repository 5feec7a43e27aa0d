"""Stage 2 (P_os+g): optimizer states, master weights and gradients partitioned.

16 elements on N = 4 ranks (one bucket, 4 elements per shard):

    parameters (compute dtype)   every rank | p p p p p p p p p p p p p p p p |
    gradient shard               rank 0 | g g g g |  rank 1 | g g g g |  ...
    master + optimizer states    rank 0 | m m m m |  rank 1 | m m m m |  ...

During backward, a hook moves each parameter's gradient into its bucket's staging buffer
and frees it; a complete bucket is reduce-scattered at once (grad_reducer: canonical order,
at most ``max_buckets_in_flight`` outstanding), overlapped with the rest of backward, and
rank r adds the reduced slice it owns into its gradient shard (accumulating over
micro-steps).

Memory per rank (mixed precision Adam, K = 12): 2Ψ + (2 + K)Ψ/N plus alignment padding
(float32 Adam: 4Ψ + 12Ψ/N, the master being this rank's slice of the parameters), plus
communication buffers from the communicator's pool, bounded by the configuration: for
each of at most ``max_buckets_in_flight + 1`` buckets being reduced, the bucket's staging
copy, the reduce-scatter's receive rows (one more bucket) and its output slice, each
rounded up to a power of two. A parameter larger than ``bucket_numel`` is a bucket of its
own, so the bound is in terms of max(bucket_numel, largest parameter). The bound holds
when backward completes buckets in reverse registration order (the usual case): buckets
are reduced strictly last-first, so a bucket that completes early (layers used in another
order than registered, or a parameter with no gradient on this rank) keeps its staging
copy until its turn, at worst every bucket until the end of backward.
Unlike DeepSpeed's stage 2 there is no extra float32 gradient partition: the float32
gradient exists only inside step().
Communication per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ (N-1)/N.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .partitioned import PartitionedEngine


class Stage2Engine(PartitionedEngine):
    def _gradient_targets(self) -> list[list[torch.Tensor]]:
        self.grad_shards = [
            torch.zeros(layout.shard_numel, dtype=self.dtype) for layout in self.layouts
        ]
        return [
            [shard[b.local_offset : b.local_offset + b.slice_numel] for b in layout.buckets]
            for shard, layout in zip(self.grad_shards, self.layouts, strict=True)
        ]

    def _build(self, initial: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        masters = super()._build(initial)
        self._register_gradient_hooks()
        return masters

    def _register_gradient_hooks(self) -> None:
        """Hand each gradient to the reducer as soon as autograd has accumulated it."""
        # A weak reference: the model's parameters must not keep a deleted engine alive.
        engine = weakref.ref(self)

        def on_gradient(param: torch.Tensor) -> None:
            alive = engine()
            if alive is not None:
                alive._on_gradient(param)

        self._hooks: list[Any] = [
            p.register_post_accumulate_grad_hook(on_gradient)  # type: ignore[no-untyped-call]
            for _, p in self.trainable_parameters()
        ]
        self._in_backward = False

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._in_backward:
            self.reducer.grad_ready(param)  # type: ignore[arg-type]

    def _reduce_gradients(self, first_micro_step: bool) -> None:
        # The hooks already handed most gradients over during backward; see backward().
        self.reducer.finish()
        self._in_backward = False

    def _before_backward(self, first_micro_step: bool) -> None:
        self.reducer.begin(first_micro_step, self.micro_step_label)
        self._in_backward = True

    def backward(self, loss: torch.Tensor) -> None:
        try:
            super().backward(loss)
        finally:
            self._in_backward = False

    def _float32_gradients(self) -> list[torch.Tensor]:
        """The gradient shards themselves when they are float32 (step() scales them in
        place and clears them after), else one float32 copy of each."""
        return [
            shard if shard.dtype == torch.float32 else shard.float() for shard in self.grad_shards
        ]

    def _clear_gradients(self) -> None:
        for shard in self.grad_shards:
            shard.zero_()

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        return list(self.grad_shards)
