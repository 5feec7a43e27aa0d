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

Components (engine.Engine): reduce_scattered_gradients (sharded, by hooks),
replicated_params, master_weights.
"""

from __future__ import annotations

from .stage_policy import GradientPlacement, ParameterPlacement, StagePolicy

POLICY = StagePolicy(
    name="stage 2",
    gradients=GradientPlacement.SHARDED,
    parameters=ParameterPlacement.REPLICATED,
    shard_optimizer_states=True,
)
