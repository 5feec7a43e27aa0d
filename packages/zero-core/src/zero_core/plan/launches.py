"""How many collectives a step launches, counted on the layout the engine builds.

A launch has a fixed cost whatever its size (the link's latency, and the engine's Python:
staging, hooks, bookkeeping), which on small models is a large part of a step. So the
counts come from the engine's own rules, run on the workload's parameters, not from a
formula of Ψ:

    parameters   zero_models' GPT in registration order (wte, wpe; per block ln_1, qkv,
                 proj, ln_2, fc, proj with their biases; ln_f; the head tied to wte): the
                 shape of any Workload, whatever its source (a Hugging Face workload's
                 gated MLP or missing biases change the counts little)
    fetch units  fetch_units.plan_units' rule: a module's own parameters of more than
                 ``persistence_threshold`` elements are one unit; the smaller ones all go
                 to the persistent unit, gathered once per step after the optimizer
    buckets      stages 1-3: StagePolicy.group_layout (GroupLayout.build; stage 3 within
                 fetch units), stage 0: allreduced_gradients' chunks of ``bucket_numel``
    reductions   grad_reducer: buckets in reverse order (stage 3: unit by unit, the last
                 unit first, the persistent one last), consecutive ones coalesced up to
                 ZeroConfig.coalesce_limit (coalescing.coalesced_groups); an oversized
                 bucket alone, in pieces of group_layout.piece_numel
    gathers      param_gatherer: per pass the first unit by itself, then each prefetch
                 starts the units ahead within ``prefetch_numel`` (and ``max_live_numel``),
                 coalesced up to ``gather_coalesce_numel``; a unit gathered alone takes an
                 all-gather per bucket; forward demands the units in registration order,
                 backward wte's (the tied head's) and then the others from the last;
                 backward starts with its head (the units forward kept) gathered
    after step   stages 1-3: the gradient checks' all-reduce and all-gather (non-finite
                 flag, norm); stages 1-2 publish every bucket (pieces if oversized);
                 stage 3 re-gathers the persistent unit

A test in zero-models holds these counts to the engine's comm.stats for zero-train's GPTs.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from ..coalescing import coalesced_groups
from ..config.zero_config import (
    DEFAULT_COALESCE_NUMEL,
    QGZ_COALESCE_NUMEL,
)
from ..group_layout import MIN_PIECE_NUMEL, GroupLayout, piece_numel
from .configuration import PlanConfig
from .workload import Workload

# ZeroConfig's defaults the plan does not vary.
PERSISTENCE_THRESHOLD = 2**12
MAX_LIVE_NUMEL = 2**28
# Collectives after the optimizer at stages 1-3: gradient_checks' all-reduce of the
# non-finite flag and all-gather of the norm's rows.
CHECK_LAUNCHES = 2


class Launches(NamedTuple):
    """Collective launches of one rank: per micro-step (forward and backward gathers, the
    gradient reductions), per step (after the optimizer), and stage 3's fetch units
    (each entered and left once per pass, two passes per micro-step)."""

    forward_gathers: int
    backward_gathers: int
    reductions: int
    after_step: int
    units: int

    def per_step(self, accumulation: int) -> int:
        """Every launch of a step of ``accumulation`` micro-steps."""
        micro = self.forward_gathers + self.backward_gathers + self.reductions
        return accumulation * micro + self.after_step


def gpt_modules(workload: Workload) -> list[list[int]]:
    """The element counts of every module's own parameters, in zero_models.gpt.GPT's
    registration order (the tied head registers none)."""
    c, blocks = workload.width, []
    for _ in range(workload.layers):
        blocks += [[c, c], [3 * c * c, 3 * c], [c * c, c], [c, c], [4 * c * c, 4 * c],
                   [4 * c * c, c]]  # fmt: skip
    return [[workload.vocab_size * c], [workload.context * c], *blocks, [c, c]]


def count_launches(workload: Workload, config: PlanConfig, group: int) -> Launches:
    """Launches of ``workload`` under ``config`` with model states sharded over ``group``
    ranks (the module docstring's rules)."""
    return _count(
        tuple(tuple(m) for m in gpt_modules(workload)), config.stage, group,
        config.bucket_numel, QGZ_COALESCE_NUMEL if config.quantize_gradients
        else DEFAULT_COALESCE_NUMEL, config.gather_coalesce_numel, config.prefetch_numel,
        config.kept_head_numel if config.stage == 3 else 0, config.keep_backward_head,
    )  # fmt: skip


@lru_cache(maxsize=1024)
def _count(
    modules: tuple[tuple[int, ...], ...], stage: int, group: int, bucket_numel: int,
    coalesce_numel: int, gather_coalesce_numel: int, prefetch_numel: int, head_numel: int,
    keep_head: bool,
) -> Launches:  # fmt: skip
    numels = [n for module in modules for n in module]
    if group < 2:
        return Launches(0, 0, 0, 0, 0)
    if stage == 0:
        return Launches(0, 0, len(_allreduce_chunks(numels, bucket_numel, group)), 0, 0)
    units, tags = _fetch_units(modules) if stage == 3 else ([], None)
    layout = GroupLayout.build(numels, group, bucket_numel, tags=tags)
    padded = [b.layout.padded_numel for b in layout.buckets]
    pieces = [_pieces(p, bucket_numel, group) for p in padded]
    order = list(range(len(padded) - 1, -1, -1))
    if tags is not None:  # sharded_params.reduce_order: units last first, the persistent last
        by_unit = sorted(range(len(units)), key=lambda u: (units[u][1], -u))
        order = [b for u in by_unit for b, bucket in enumerate(layout.buckets)
                 if tags[bucket.param_indices[0]] == u]  # fmt: skip
    # grad_reducer._oversized: a bucket of several parameters goes whole (only alignment
    # padding can take it past bucket_numel); publishing cuts it all the same.
    alone = [
        k > 1 and len(b.param_indices) == 1 for k, b in zip(pieces, layout.buckets, strict=True)
    ]
    limit = min(coalesce_numel, bucket_numel)
    reductions = sum(
        pieces[g[0]] if alone[g[0]] else 1 for g in coalesced_groups(order, padded, alone, limit)
    )
    if stage in (1, 2):
        return Launches(0, 0, reductions, CHECK_LAUNCHES + sum(pieces), 0)
    assert tags is not None
    per_unit = [0] * len(units)  # buckets of each unit: a unit gathered alone, one each
    for bucket in layout.buckets:
        per_unit[tags[bucket.param_indices[0]]] += 1
    sharded = [(n, per_unit[u]) for u, (n, persistent) in enumerate(units) if not persistent]
    forward = _pass_gathers(sharded, set(), prefetch_numel, gather_coalesce_numel)
    # Backward starts at the tied head (lm_head: wte's unit, the first), then the blocks
    # from the last, down to wpe.
    backward_order = sharded[:1] + sharded[:0:-1]
    kept = _head([n for n, _ in backward_order], head_numel) if keep_head else set()
    backward = _pass_gathers(backward_order, kept, prefetch_numel, gather_coalesce_numel)
    persistent = int(any(p for _, p in units))
    return Launches(forward, backward, reductions, CHECK_LAUNCHES + persistent, len(sharded))


def _allreduce_chunks(numels: list[int], bucket_numel: int, world: int) -> list[int]:
    """allreduced_gradients.AllReducedGradients._chunks' sizes: ranges of at most
    max(bucket_numel, MIN_PIECE_NUMEL N) elements ending at parameter boundaries where whole
    parameters fit, a larger parameter cut into pieces of that many."""
    limit = max(bucket_numel, MIN_PIECE_NUMEL * world)
    chunks, start, stop = [], 0, 0
    for numel in numels:
        if stop > start and stop + numel - start > limit:
            chunks.append(stop - start)
            start = stop
        stop += numel
        while stop - start > limit:
            chunks.append(limit)
            start += limit
    if stop > start:
        chunks.append(stop - start)
    return chunks


def _fetch_units(
    modules: tuple[tuple[int, ...], ...], threshold: int = PERSISTENCE_THRESHOLD
) -> tuple[list[tuple[int, bool]], list[int]]:
    """(elements, persistent) of every unit, the persistent one last, and each parameter's
    unit (fetch_units.plan_units' numbering)."""
    units: list[tuple[int, bool]] = []
    owner: list[int | None] = []
    for module in modules:
        own = None
        for numel in module:
            if numel <= threshold:
                owner.append(None)
                continue
            if own is None:
                units.append((0, False))
                own = len(units) - 1
            units[own] = (units[own][0] + numel, False)
            owner.append(own)
    small = [n for module in modules for n in module if n <= threshold]
    if small:
        units.append((sum(small), True))
    last = len(units) - 1
    return units, [last if o is None else o for o in owner]


def _pieces(padded: int, bucket_numel: int, group: int) -> int:
    """Collectives one bucket is moved in (group_layout.piece_numel)."""
    slice_numel = padded // group
    return max(1, math.ceil(slice_numel / max(1, piece_numel(padded, bucket_numel, group))))


def _head(order: list[int], head_numel: int) -> set[int]:
    """Positions of backward's head: its first unit and the units after it within
    ``head_numel`` elements (param_gatherer.backward_head_length)."""
    kept, filled = {0} if order else set(), 0
    for position in range(1, len(order)):
        if filled + order[position] > head_numel:
            break
        kept.add(position)
        filled += order[position]
    return kept


def _pass_gathers(
    order: list[tuple[int, int]], kept: set[int], prefetch: int, coalesce: int
) -> int:
    """All-gathers of one pass over units of ``order`` (elements, buckets), as
    param_gatherer prefetches: a unit not started when demanded is gathered by itself, an
    all-gather per bucket; after each demand the units ahead start while they fit
    ``prefetch`` elements ahead (and MAX_LIVE_NUMEL gathered), in runs of up to
    ``coalesce`` elements, one all-gather a run (a run of one unit: one a bucket).
    ``kept``: positions already gathered (backward's head), counted as ahead."""
    started = set(kept)
    ahead = sum(order[p][0] for p in kept)
    live = ahead
    launches = 0
    for position, (numel, buckets) in enumerate(order):
        if position not in started:
            started.add(position)
            launches += buckets
            live += numel
        else:
            ahead -= numel
        if prefetch > 0:
            batch: list[int] = []
            for nxt in range(position + 1, len(order)):
                size = order[nxt][0]
                if nxt in started:
                    continue
                if ahead + size > prefetch or live + size > MAX_LIVE_NUMEL:
                    break
                batch.append(nxt)
                started.add(nxt)
                ahead += size
                live += size
            sizes = [order[p][0] for p in batch]
            runs = coalesced_groups(range(len(batch)), sizes, [False] * len(batch), coalesce)
            launches += sum(order[batch[r[0]]][1] if len(r) == 1 else 1 for r in runs)
        live -= numel  # released after its use (the kept head is gone by backward's end)
    return launches
