"""Stage 0: plain data parallelism, the oracle every other stage must equal bit for bit.

Every rank holds everything; per micro-step, the gradients of each group (one flat buffer
in parameter order) are all-reduced in chunks of bucket_numel elements, each launched during
backward once its gradients are in (DDP's reducer; overlap_comm=False: after backward);
the optimizer updates the full float32 master weights.

    16 elements, N = 4 ranks:   every rank  | p p p p p p p p p p p p p p p p |  (all of it)

Memory per rank (mixed precision Adam, K = 12): (2 + 2 + K) Ψ, plus 2Ψ for the reduced
sum when accumulating over several micro-steps.
Communication per step: one all-reduce of Ψ elements, 2Ψ (N-1)/N in the ring convention.

Components (engine.Engine): allreduced_gradients, replicated_params, and master_weights
over a layout of one rank per group (the whole group, no gaps).
"""

from __future__ import annotations

from .stage_policy import GradientPlacement, ParameterPlacement, StagePolicy

POLICY = StagePolicy(
    name="stage 0",
    gradients=GradientPlacement.REPLICATED_VIEWS,
    parameters=ParameterPlacement.REPLICATED,
    shard_optimizer_states=False,
)
