"""Device working memory of a step besides the model states: the bounded buffers that the
configuration, not the model's size, sets (ZeRO-R's C_B), and stage 3's gathered units.

With the model states offloaded (ZeRO-Offload, ZeRO-Infinity) these are most of what the
device holds, so an estimate that leaves them out says a model fits that does not. Per
rank, bytes, at the peak of backward (the upper bound the engine's configuration sets):

    stages 2, 3  gradient buckets   (M + 1) b (2 + 1/N) g c   M = max_buckets_in_flight,
                                                               b = bucket_numel: each bucket
                                    being reduced (M) and the one being filled (+1): its
                                    staging copy, the reduce-scatter's receive rows and this
                                    rank's reduced slice (stage2.py's bound), each rounded up
                                    to the communicator's pool's size class, c = 1 + 1/8
                                    (zero_comm.buffers; MemoryReport's ``comm_buffers``)
                 autograd gradient  P p                        P = the largest parameter: its
                                    gradient as autograd hands it over, before a hook moves
                                    it into staging; one larger than b is never staged but
                                    reduced from where it is, in pieces (grad_reducer)
    stage 3      gathered units     (U + W) p                  U = the largest fetch unit
                                    (running now), W = min(max_live_numel, max(prefetch_numel,
                                    backward_head_numel)): the units gathered ahead, or kept
                                    from forward for backward's start (param_gatherer)
                 coalesced gathers  C (1 + 1/N) p              C = gather_coalesce_numel: a
                                    coalesced all-gather's received and send buffers

g is the gradient's reduce width (``reduce_dtype``), p the compute dtype's. The stage 3
terms are the same whichever tier holds the parameter shards: a shard fetched from host
memory or disk is gathered into the same full buffers. Not counted: the persistent unit
(parameters of at most ``persistence_threshold`` elements; none of a large transformer's),
activations (zero_core.estimate.activations) and the allocator's fragmentation.

This is ZeRO-Infinity's "model state working memory" (Rajbhandari et al. 2021, sec. 4.1):
a transformer's largest operator, the h x 4h linear layer, with its fp16 parameter and
gradient, 2 x 2 x 4h^2 bytes, here U p + P p, plus the configuration's buffers.
"""

from __future__ import annotations

from typing import NamedTuple

from zero_comm.buffers import CLASSES_PER_OCTAVE

# A pooled buffer is at most this much larger than asked for (zero_comm.buffers).
SIZE_CLASS_SLACK = 1 + 1 / CLASSES_PER_OCTAVE


class WorkingBytes(NamedTuple):
    """Bytes of a rank's device working memory, by what holds them (module docstring)."""

    gradient_buckets: float
    autograd_gradient: float
    gathered_units: float
    coalesced_gathers: float

    @property
    def total(self) -> float:
        return (
            self.gradient_buckets
            + self.autograd_gradient
            + self.gathered_units
            + self.coalesced_gathers
        )


def working_bytes(
    stage: int,
    world_size: int,
    *,
    param_bytes: float,
    grad_bytes: float,
    bucket_numel: int,
    max_buckets_in_flight: int,
    largest_param_numel: float = 0,
    largest_unit_numel: float = 0,
    prefetch_numel: int = 0,
    max_live_numel: int = 2**28,
    backward_head_numel: int = 0,
    gather_coalesce_numel: int = 0,
) -> WorkingBytes:
    """The device working memory of one rank at ``stage`` (module docstring): stages 0
    and 1 reduce full gradient buffers in place (counted as model states), so they add
    nothing here. ``backward_head_numel``: 0 when ``keep_backward_head`` is off."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0-3")
    if world_size < 1 or bucket_numel < 1 or max_buckets_in_flight < 1:
        raise ValueError(
            "world_size, bucket_numel and max_buckets_in_flight must be >= 1, got "
            f"{world_size}, {bucket_numel} and {max_buckets_in_flight}"
        )
    if stage < 2:
        return WorkingBytes(0.0, 0.0, 0.0, 0.0)
    n = world_size
    rows = 2 + 1 / n  # staging copy, receive rows, reduced slice: in buckets
    buckets = (max_buckets_in_flight + 1) * bucket_numel * rows * grad_bytes * SIZE_CLASS_SLACK
    autograd = largest_param_numel * param_bytes
    gathered = coalesced = 0.0
    if stage == 3:
        ahead = min(max_live_numel, max(prefetch_numel, backward_head_numel))
        gathered = (largest_unit_numel + ahead) * param_bytes
        coalesced = gather_coalesce_numel * (1 + 1 / n) * param_bytes
    return WorkingBytes(buckets, autograd, gathered, coalesced)


def transformer_largest(vocab_size: int, width: int, tp: int = 1) -> tuple[float, float]:
    """(largest parameter, largest fetch unit) of a GPT-2-style model, in elements per
    tensor-parallel rank: the token embedding (V x C, tied with the head) or the MLP's
    C -> 4C linear layer (4C^2 weight, 4C bias; one fetch unit per module), whichever is
    larger (zero_models.gpt)."""
    embedding = vocab_size * width / tp
    fc_weight = 4 * width * width / tp
    return max(embedding, fc_weight), max(embedding, fc_weight + 4 * width / tp)
