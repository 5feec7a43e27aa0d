"""Stage 1 (P_os): optimizer states and float32 master weights partitioned; gradients not.

16 elements on N = 4 ranks (one bucket, 4 elements per shard):

    parameters (compute dtype)   every rank | p p p p p p p p p p p p p p p p |
    gradients  (compute dtype)   every rank | g g g g g g g g g g g g g g g g |  (p.grad views)
    master + optimizer states    rank 0 | m m m m |  rank 1 | m m m m |  ...  (its quarter)

Each bucket of the full gradient is reduce-scattered during backward, as soon as its
gradients are in (overlap_comm=False: after backward): rank r receives the reduced quarter
it owns, steps its master quarter, and all-gathers the updated parameters.

Memory per rank (mixed precision Adam, K = 12): 2Ψ + 2Ψ + KΨ/N = 4Ψ + KΨ/N, plus the
alignment padding of the buckets; float32 Adam: 4Ψ + 4Ψ + 8Ψ/N (the master is this
rank's slice of the parameters themselves, see master_weights). With gradient accumulation
the reduced slices accumulate in a separate shard of 2Ψ/N (the full gradient buffer is
reused by every micro-step).
Communication per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ (N-1)/N, the same as stage 0.

Components (engine.Engine): reduce_scattered_gradients with full buffers,
replicated_params, master_weights.
"""

from __future__ import annotations

from .stage_policy import GradientPlacement, ParameterPlacement, StagePolicy

POLICY = StagePolicy(
    name="stage 1",
    gradients=GradientPlacement.REPLICATED_BUCKETS,
    parameters=ParameterPlacement.REPLICATED,
    shard_optimizer_states=True,
)
