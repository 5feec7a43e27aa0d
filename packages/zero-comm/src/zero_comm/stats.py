"""Counts of collective calls and of the data they move, in the ring convention.

The volume of a collective is what one rank sends with a bandwidth-optimal (ring)
algorithm, for a buffer of B elements on N ranks:

    all_reduce       2 (N-1)/N * B     (reduce-scatter then all-gather)
    reduce_scatter     (N-1)/N * B     (B = the full input, N chunks)
    all_gather         (N-1)/N * B     (B = the full output, N chunks)
    all_to_all         (N-1)/N * B     (B = the full input, N chunks; one stays)
    broadcast                    B

This is the convention of the ZeRO paper, so an engine's traffic can be compared with its
2Ψ (stages 0-2) and 3Ψ (stage 3) exactly. The count is of the collective the caller asked
for, whatever algorithm the backend uses underneath. Volumes are exact fractions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

RING_FACTOR_NUMERATOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


def ring_volume(collective: str, buffer_numel: int, world_size: int) -> Fraction:
    """Elements one rank moves for ``collective`` on a buffer of ``buffer_numel`` elements."""
    if collective == "broadcast":
        return Fraction(buffer_numel) if world_size > 1 else Fraction(0)
    if collective == "barrier":
        return Fraction(0)
    factor = RING_FACTOR_NUMERATOR[collective]
    return Fraction(factor * (world_size - 1) * buffer_numel, world_size)


@dataclass
class CollectiveCount:
    """What one kind of collective has done since the last reset."""

    calls: int = 0
    buffer_elements: int = 0
    volume_elements: Fraction = field(default_factory=Fraction)
    volume_bytes: Fraction = field(default_factory=Fraction)


class CommStats:
    """Per-collective counters of one communicator; ``reset()`` starts them again."""

    COLLECTIVES = (
        "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier",
    )  # fmt: skip

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._counts = {name: CollectiveCount() for name in self.COLLECTIVES}

    def record(self, collective: str, buffer_numel: int, itemsize: int) -> None:
        count = self._counts[collective]
        volume = ring_volume(collective, buffer_numel, self.world_size)
        count.calls += 1
        count.buffer_elements += buffer_numel
        count.volume_elements += volume
        count.volume_bytes += volume * itemsize

    def __getitem__(self, collective: str) -> CollectiveCount:
        return self._counts[collective]

    @property
    def total_volume_bytes(self) -> Fraction:
        return sum((c.volume_bytes for c in self._counts.values()), Fraction(0))

    @property
    def total_volume_elements(self) -> Fraction:
        return sum((c.volume_elements for c in self._counts.values()), Fraction(0))

    def reset(self) -> None:
        for name in self.COLLECTIVES:
            self._counts[name] = CollectiveCount()

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        """A JSON-friendly copy: calls, buffer elements, and volumes as floats."""
        return {
            name: {
                "calls": c.calls,
                "buffer_elements": c.buffer_elements,
                "volume_elements": float(c.volume_elements),
                "volume_bytes": float(c.volume_bytes),
            }
            for name, c in self._counts.items()
        }
