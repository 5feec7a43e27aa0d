"""Bytes one training step sends over intra-node and inter-node links, from the formulas.

Every collective an engine issues in one step of A micro-steps (no clipping), each
counted by zero_comm's rule (zero_comm.stats: ring successor, all_to_all by destination,
a broadcast's ring ending at its root), summed over all N ranks. With buckets of b
elements (padded, w bytes each; none past bucket_numel, as an oversized one is reduced in
pieces, each coded on its own), N = R x S ranks, nodes of ``ranks_per_node`` consecutive
ranks:

    stage 0     all_reduce(b) over the world (b: the flat gradient, in any pieces)
    gradients   flat:    reduce_scatter(b) over the world
                hybrid:  all_to_all(b) in each shard group; the fold's hops j -> j+1, a
                         broadcast of b/S in each pair of replicas; the result, a broadcast
                         of b/S from replica R-1 over each replica group
                hybrid, native communicator: reduce_scatter(b) in each shard group, then
                         all_reduce(b/S) over each replica group; with A > 1 that
                         all_reduce runs once per step, not per micro-step
                qgZ:     all_to_all of N coded chunks of b/N in each node, then of M coded
                         node partials across nodes (zero_comm.quantized)
                + one int32 all_reduce (the non-finite flag) in each shard group
    parameters  stages 1-2: all_gather(b) in each shard group after the step
                stage 3: forward all_gather(b) in each shard group (qwZ: S coded parts);
                         backward the same, or with hpZ all_gather(b) in each hpZ group,
                         except for the buckets of the units forward kept gathered for
                         backward's start (param_gatherer: the backward head)

Gradients and stage 3's gathers count A times (every micro-step), the rest once. Gradient
collectives move ``reduce_bytes`` per element (``ZeroConfig.reduce_dtype``: 4 for float32
reductions of 16-bit compute), parameter gathers ``dtype_bytes`` (the compute dtype); qgZ
and qwZ move their coded bytes whatever the dtype.

:func:`step_link_bytes` computes it; tests hold engines' measured stats to it exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from zero_comm import BlockQuantizer, CommStats, Topology

from ..param_gatherer import backward_head_length
from ..zeropp import GRADIENT_BLOCK_NUMEL, WEIGHT_BLOCK_NUMEL


@dataclass(frozen=True)
class LinkBytes:
    """Bytes sent in one step, summed over every rank, by link class."""

    intra_node: Fraction
    inter_node: Fraction
    world_size: int

    def per_rank(self) -> tuple[float, float]:
        """(intra, inter) bytes per rank on average."""
        return float(self.intra_node / self.world_size), float(self.inter_node / self.world_size)


class _Tally:
    """Counts collectives on groups of world ranks with zero_comm's own stats rule."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.intra = Fraction(0)
        self.inter = Fraction(0)

        self.times = 1  # how many equal buckets the next additions stand for

    def add(
        self,
        groups: Sequence[Sequence[int]],
        collective: str,
        numel: int,
        itemsize: int,
        root: int | None = None,
    ) -> None:
        for members in groups:
            if len(members) < 2:
                continue
            sub = self.topology.restrict(members)
            for index in range(len(members)):
                stats = CommStats(len(members), rank=index, topology=sub)
                stats.record(collective, numel, itemsize, root)
                self.intra += stats.intra_node_bytes * self.times
                self.inter += stats.inter_node_bytes * self.times


def step_link_bytes(
    bucket_numels: Sequence[int],
    *,
    world_size: int,
    ranks_per_node: int,
    stage: int,
    dtype_bytes: int,
    shard_group_size: int | None = None,
    hpz_partition_size: int = 1,
    quantize_weights: bool = False,
    quantize_gradients: str | None = None,
    accumulation_steps: int = 1,
    deterministic: bool = True,
    kept_bucket_numels: Sequence[int] = (),
    reduce_bytes: int | None = None,
) -> LinkBytes:
    """One step's bytes by link class (see the module docstring); ``bucket_numels``:
    each bucket's padded elements (a multiple of the shard group's size); ``reduce_bytes``:
    bytes per gradient element reduced (None: ``dtype_bytes``, gradients reduced in the
    compute dtype);
    ``kept_bucket_numels``: stage 3, those of the buckets whose units stay gathered from
    forward to backward (none on the first step, which has no backward record yet)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0-3")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps}: at least 1")
    n, s = world_size, shard_group_size or world_size
    r, p = n // s, hpz_partition_size
    tally = _Tally(Topology.uniform(n, ranks_per_node))
    shard = [list(range(g * s, (g + 1) * s)) for g in range(r)]
    replica = [list(range(j, n, s)) for j in range(s)]
    pairs = [[j + k * s, j + (k + 1) * s] for j in range(s) for k in range(r - 1)]
    nodes = [
        list(range(m * ranks_per_node, (m + 1) * ranks_per_node))
        for m in range(n // ranks_per_node)
    ]
    across = [list(range(local, n, ranks_per_node)) for local in range(ranks_per_node)]
    hpz = [list(range(a, a + p)) for a in range(0, n, p)]
    a = accumulation_steps
    g = dtype_bytes if reduce_bytes is None else reduce_bytes
    kept, held = Counter(kept_bucket_numels), Counter(bucket_numels)
    if (stage != 3 and kept) or any(kept[b] > held[b] for b in kept):
        raise ValueError(
            f"kept_bucket_numels={list(kept_bucket_numels)}: only stage 3 keeps buckets, "
            "and each must be one of bucket_numels"
        )
    for b, times in sorted(held.items()):  # equal buckets count alike
        tally.times = times * a  # per micro-step
        if stage == 0:  # replicas reduce alike: no flag to agree on
            tally.add(shard, "all_reduce", b, g)
            continue
        if quantize_gradients is not None:
            codec = BlockQuantizer(4 if quantize_gradients == "int4" else 8, GRADIENT_BLOCK_NUMEL)
            coded = codec.encoded_numel(b // n)
            tally.add(nodes, "all_to_all", n * coded, 1)
            tally.add(across, "all_to_all", (n // ranks_per_node) * coded, 1)
        elif r > 1 and not deterministic:
            tally.add(shard, "reduce_scatter", b, g)
            tally.times = times  # once per step: at the accumulation boundary
            tally.add(replica, "all_reduce", b // s, g)
            tally.times = times * a
        elif r > 1:
            tally.add(shard, "all_to_all", b, g)
            tally.add(pairs, "broadcast", b // s, g, root=0)
            tally.add(replica, "broadcast", b // s, g, root=r - 1)
        else:
            tally.add(shard, "reduce_scatter", b, g)
        if stage < 3:
            tally.times = times  # after the step
            tally.add(shard, "all_gather", b, dtype_bytes)
            continue
        if quantize_weights:
            weights = BlockQuantizer(8, WEIGHT_BLOCK_NUMEL)
            tally.add(shard, "all_gather", s * weights.encoded_numel(b // s), 1)
        else:
            tally.add(shard, "all_gather", b, dtype_bytes)
        tally.times = (times - kept[b]) * a  # backward gathers what forward did not keep
        if p > 1:
            tally.add(hpz, "all_gather", b, dtype_bytes)
        elif quantize_weights:
            tally.add(shard, "all_gather", s * weights.encoded_numel(b // s), 1)
        else:
            tally.add(shard, "all_gather", b, dtype_bytes)
    tally.times = 1
    if stage > 0:
        tally.add(shard, "all_reduce", 1, 4)  # the non-finite flag
    return LinkBytes(tally.intra, tally.inter, n)


def even_buckets(numel: int, bucket_numel: int, shard_size: int) -> list[int]:
    """An estimate's buckets: ``numel`` elements in buckets of ``bucket_numel`` (the last
    shorter), each padded to a multiple of ``shard_size``."""
    full, rest = divmod(int(numel), bucket_numel)
    sizes = [bucket_numel] * full + ([rest] if rest else [])
    return [-(-b // shard_size) * shard_size for b in sizes]


def backward_head_buckets(bucket_numels: Sequence[int], head_numel: int) -> list[int]:
    """An estimate's stage-3 backward head: the buckets a forward keeps gathered for
    backward's start, with each bucket one gather unit, gathered in forward in the given
    order and in backward in the reverse one (a stack of blocks).

    By param_gatherer's own rule (backward_head_length): backward's first unit
    (forward's last bucket) always, then the ones before it while they total at most
    ``head_numel`` elements (``ZeroConfig.backward_head_numel``)::

        forward  ->  [b0][b1][b2][b3][b4]
                              <---- head_numel ----|first|
        kept:                 b2  b3               b4       (if b2 + b3 <= head_numel)
    """
    if head_numel < 0:
        raise ValueError(f"head_numel={head_numel}: at least 0")
    backward = list(reversed(bucket_numels))
    return backward[: backward_head_length(backward, head_numel)]
