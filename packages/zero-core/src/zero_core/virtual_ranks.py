"""Virtual ranks: physical ranks that each run several micro-batch slots per micro-step.

With ``ZeroConfig(micro_batches_per_rank=(c_0, ..., c_{N-1}))`` physical rank i hosts the
c_i consecutive virtual ranks o_i .. o_i + c_i - 1, o_i = c_0 + ... + c_{i-1}, out of
V = sum(c) (issue 52, "virtual ranks"). Counts (2, 1) on two ranks:

    physical rank      0            1
    virtual ranks    0    1         2
    backward calls per micro-step: 2 on rank 0, 1 on rank 1

Each slot's gradient enters the rank-ordered reduction as the row of its virtual rank
(zero_comm's all_reduce_rows / reduce_scatter_rows), so the run equals, bit for bit, the
homogeneous run at V ranks fed the same micro-batches. A homogeneous run is counts (1,)*N.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config.micro_batches_rule import CountsSetting, normalise_counts


@dataclass(frozen=True)
class VirtualRanks:
    """Which virtual ranks each physical rank hosts.

    Attributes:
        counts: c_i for every physical rank i of the data-parallel group.
        rank: this process's physical rank in that group.
    """

    counts: tuple[int, ...]
    rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(self.counts))
        normalise_counts("counts", self.counts)
        if not 0 <= self.rank < len(self.counts):
            raise ValueError(
                f"VirtualRanks: rank {self.rank} is not one of the {len(self.counts)} ranks"
            )

    @classmethod
    def homogeneous(cls, world_size: int, rank: int) -> VirtualRanks:
        """One virtual rank per physical rank (every run without micro_batches_per_rank)."""
        return cls((1,) * world_size, rank)

    @classmethod
    def for_world(cls, setting: CountsSetting, world_size: int, rank: int) -> VirtualRanks:
        """The virtual ranks a config's ``micro_batches_per_rank`` gives on this world.

        Raises ValueError when the counts do not fit the world, and for "auto", which must
        be resolved to counts before the engine is built."""
        if setting is None:
            return cls.homogeneous(world_size, rank)
        if setting == "auto":
            raise ValueError(
                "micro_batches_per_rank='auto' must be resolved to counts before "
                "zero_core.initialize: zero-train's profiler does it (zero-train "
                "--micro-batches-per-rank auto), or call "
                "zero_core.hetero.choose_micro_batches(...) and pass its counts, or pass "
                "the counts yourself, e.g. micro_batches_per_rank=[2, 1]"
            )
        if len(setting) != world_size:
            raise ValueError(
                f"micro_batches_per_rank={list(setting)!r} has {len(setting)} entries but the "
                f"data-parallel world has {world_size} ranks; give one count per rank"
            )
        return cls(tuple(setting), rank)

    @property
    def total(self) -> int:
        """V: the virtual ranks of the whole group (the homogeneous run's world size)."""
        return sum(self.counts)

    @property
    def first(self) -> int:
        """o_i: the first virtual rank this physical rank hosts."""
        return sum(self.counts[: self.rank])

    @property
    def count(self) -> int:
        """c_i: the virtual ranks (backward calls per micro-step) of this physical rank."""
        return self.counts[self.rank]

    @property
    def homogeneous_run(self) -> bool:
        """Whether every rank hosts one virtual rank (the plain collectives apply)."""
        return all(c == 1 for c in self.counts)

    def of_rank(self, rank: int) -> range:
        """The virtual ranks physical rank ``rank`` hosts."""
        start = sum(self.counts[:rank])
        return range(start, start + self.counts[rank])
