"""Counts of collective calls and of the data they move, in the ring convention.

The volume of a collective is what one rank sends with a bandwidth-optimal (ring)
algorithm, for a buffer of B elements on N ranks:

    all_reduce       2 (N-1)/N * B     (reduce-scatter then all-gather)
    reduce_scatter     (N-1)/N * B     (B = the full input, N chunks)
    all_gather         (N-1)/N * B     (B = the full output, N chunks)
    all_to_all         (N-1)/N * B     (B = the full input, N chunks; one stays)
    broadcast                    B     (0 on the rank whose ring successor is the root)

A broadcast is a pipelined ring from its root: every rank forwards B to its successor
except the last one, so the N ranks together send (N-1) B, what really moves.

This is the convention of the ZeRO paper, so an engine's traffic can be compared with its
2Ψ (stages 0-2) and 3Ψ (stage 3) exactly. The count is of the collective the caller asked
for, whatever algorithm the backend uses underneath. Volumes are exact fractions.

Each volume is split by link class, intra-node + inter-node = volume, exactly, by the
communicator's topology (zero_comm.topology):

- all_reduce, reduce_scatter, all_gather, broadcast (ring collectives): this rank sends its
  whole volume to its ring successor, rank + 1 mod N within this communicator, so all of
  it is inter-node when the successor is on another node, and none of it otherwise.
- all_to_all: exact by destination. B/N elements go to each other rank: inter-node for
  those on another node, intra-node for those on this one.

Two nodes of two ranks, ring 0 -> 1 -> 2 -> 3 -> 0 (``-->`` intra-node, ``==>`` inter-node):

      node 0            node 1
    [0] --> [1] ==> [2] --> [3]
     ^                       ||
     ++======================++

Ranks 1 and 3 send all of their ring volume across nodes, ranks 0 and 2 none of it. An
all_to_all of B elements: every rank sends B/4 within its node and 2B/4 across.

Summed over the ranks, a ring collective's inter-node bytes are (number of ring links that
cross nodes) x the volume of one rank: 2 links here, k for k > 1 contiguous nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from .topology import Topology

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
    """What one kind of collective has done since the last reset.

    ``intra_node_bytes + inter_node_bytes == volume_bytes`` always (see the module's rule).
    """

    calls: int = 0
    buffer_elements: int = 0
    volume_elements: Fraction = field(default_factory=Fraction)
    volume_bytes: Fraction = field(default_factory=Fraction)
    intra_node_bytes: Fraction = field(default_factory=Fraction)
    inter_node_bytes: Fraction = field(default_factory=Fraction)


class CommStats:
    """Per-collective counters of one rank of one communicator; ``reset()`` starts them again.

    ``rank`` and ``topology`` (default: every rank on one node) decide the intra-/inter-node
    split; :meth:`set_topology` changes the rule for what is recorded from then on.
    """

    COLLECTIVES = (
        "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier",
    )  # fmt: skip

    def __init__(self, world_size: int, *, rank: int = 0, topology: Topology | None = None) -> None:
        self.world_size = world_size
        self._counts = {name: CollectiveCount() for name in self.COLLECTIVES}
        self.set_topology(topology or Topology.single_node(world_size), rank)

    def set_topology(self, topology: Topology, rank: int) -> None:
        """Split what is recorded from now on by ``topology``, as rank ``rank`` sees it."""
        if topology.world_size != self.world_size or not 0 <= rank < self.world_size:
            raise ValueError(
                f"CommStats: a topology of {topology.world_size} ranks and rank {rank} do not "
                f"fit a communicator of {self.world_size} ranks"
            )
        successor = (rank + 1) % self.world_size
        self._successor = successor
        self._ring_crosses = not topology.same_node(rank, successor)
        self._peers_off_node = sum(not topology.same_node(rank, r) for r in range(self.world_size))

    def record(
        self, collective: str, buffer_numel: int, itemsize: int, root: int | None = None
    ) -> None:
        """Count one call; ``root``: a broadcast's source rank (None: count B, as if this
        rank forwarded it)."""
        count = self._counts[collective]
        volume = ring_volume(collective, buffer_numel, self.world_size)
        if collective == "broadcast" and root == self._successor:
            volume = Fraction(0)  # the ring ends here: the root already has the data
        if collective == "all_to_all":
            inter = Fraction(self._peers_off_node * buffer_numel, self.world_size)
        else:
            inter = volume if self._ring_crosses else Fraction(0)
        count.calls += 1
        count.buffer_elements += buffer_numel
        count.volume_elements += volume
        count.volume_bytes += volume * itemsize
        count.inter_node_bytes += inter * itemsize
        count.intra_node_bytes += (volume - inter) * itemsize

    def __getitem__(self, collective: str) -> CollectiveCount:
        return self._counts[collective]

    @property
    def total_volume_bytes(self) -> Fraction:
        return sum((c.volume_bytes for c in self._counts.values()), Fraction(0))

    @property
    def total_volume_elements(self) -> Fraction:
        return sum((c.volume_elements for c in self._counts.values()), Fraction(0))

    @property
    def intra_node_bytes(self) -> Fraction:
        """Bytes this rank sent to ranks on its own node, over every collective."""
        return sum((c.intra_node_bytes for c in self._counts.values()), Fraction(0))

    @property
    def inter_node_bytes(self) -> Fraction:
        """Bytes this rank sent to ranks on other nodes, over every collective."""
        return sum((c.inter_node_bytes for c in self._counts.values()), Fraction(0))

    def reset(self) -> None:
        for name in self.COLLECTIVES:
            self._counts[name] = CollectiveCount()

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        """A JSON-friendly copy, one row per collective: calls, buffer elements, and the
        volumes (elements, bytes, intra-node and inter-node bytes) as floats."""
        return {
            name: {
                "calls": c.calls,
                "buffer_elements": c.buffer_elements,
                "volume_elements": float(c.volume_elements),
                "volume_bytes": float(c.volume_bytes),
                "intra_node_bytes": float(c.intra_node_bytes),
                "inter_node_bytes": float(c.inter_node_bytes),
            }
            for name, c in self._counts.items()
        }
