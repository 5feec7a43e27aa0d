"""The node-aware part of a :class:`~zero_comm.communicator.Communicator`: its topology,
the sub-communicators made from it, and the family of groups whose bytes are summed.

    N = 4 ranks on 2 nodes:   intra_node()  {0, 1} {2, 3}      (the ranks of one node)
                              inter_node()  {0, 2} {1, 3}      (one rank of each node)
                              shard_groups(2) ({0, 1} {2, 3}, {0, 2} {1, 3})

Sub-communicators are made by ``split`` on first request and kept, so every rank must ask
for them in the same order. :class:`NodeGroups` is a base of Communicator, as
call_check.CallCheck is.
"""

from __future__ import annotations

import abc
import weakref
from fractions import Fraction
from typing import TYPE_CHECKING

from .stats import CommStats
from .topology import Topology, divisors

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


class NodeGroups(abc.ABC):
    """Topology, node sub-communicators and the split family (see the module docstring)."""

    rank: int
    world_size: int
    stats: CommStats
    _topology: Topology
    # Sub-communicators made by intra_node, inter_node and shard_groups, by request.
    _groups: dict[tuple[str, int], tuple[Self, ...]]
    # Communicators split from this one (weakly: an engine's groups die with it).
    _children: list[weakref.ref[Self]]

    @abc.abstractmethod
    def _err(self, message: str) -> str: ...

    @abc.abstractmethod
    def split(self, color: int, key: int | None = None) -> Self: ...

    @property
    def topology(self) -> Topology:
        """Which ranks of this communicator share a node (see :meth:`set_topology`)."""
        return self._topology

    def set_topology(self, topology: Topology | int) -> None:
        """Override the topology, locally: every rank must pass the same value.

        ``topology`` is a :class:`Topology` of ``world_size`` ranks, or a number of ranks
        per node (``Topology.uniform``: rank r on node r // ranks_per_node). The stats split
        what they record from now on by it; ``intra_node`` and ``inter_node`` made before
        are forgotten (and made anew, collectively, at their next call).
        """
        if isinstance(topology, int) and not isinstance(topology, bool):
            try:
                topology = Topology.uniform(self.world_size, topology)
            except ValueError as exc:
                raise ValueError(self._err(f"set_topology: {exc}")) from None
        if not isinstance(topology, Topology):
            raise TypeError(
                self._err(
                    f"set_topology: expected a Topology or a number of ranks per node, got "
                    f"{topology!r}"
                )
            )
        if topology.world_size != self.world_size:
            raise ValueError(
                self._err(
                    f"set_topology: the topology has {topology.world_size} ranks but this "
                    f"communicator {self.world_size}"
                )
            )
        self._topology = topology
        self.stats.set_topology(topology, self.rank)
        self._groups.pop(("intra_node", 0), None)
        self._groups.pop(("inter_node", 0), None)

    def family(self) -> list[Self]:
        """This communicator and every live one split from it, recursively (this rank's
        members of them): the groups an engine's traffic goes through."""
        out: list[Self] = [self]
        for ref in self._children:
            child = ref()
            if child is not None:
                out += child.family()
        return out

    def family_link_bytes(self) -> tuple[Fraction, Fraction]:
        """(intra-node, inter-node) bytes this rank sent, over :meth:`family`'s stats."""
        family = self.family()
        return (
            sum((c.stats.intra_node_bytes for c in family), Fraction(0)),
            sum((c.stats.inter_node_bytes for c in family), Fraction(0)),
        )

    # ------------------------------------------------------- topology subgroups
    def intra_node(self) -> Self:
        """Collective, the first time: the ranks of this rank's node, in rank order.

        Made by ``split`` on the first call and kept (until ``set_topology``), so every rank
        must call ``intra_node``, ``inter_node`` and ``shard_groups`` in the same order.
        """
        key = ("intra_node", 0)
        if key not in self._groups:
            self._groups[key] = (self.split(color=self.topology.node_of[self.rank]),)
        return self._groups[key][0]

    def inter_node(self) -> Self:
        """Collective, the first time: the ranks with this rank's local index on every node
        (its position among its node's ranks), in rank order. Needs the same number of
        ranks on every node. Kept as :meth:`intra_node` is; the same calling rule."""
        key = ("inter_node", 0)
        if key not in self._groups:
            topology = self.topology
            if topology.ranks_per_node is None:
                counts = {n: len(topology.local_ranks(n)) for n in topology.nodes}
                raise ValueError(
                    self._err(
                        f"inter_node: the nodes hold unequal numbers of ranks ({counts}, node: "
                        "ranks), so no group has one rank of each; use shard_groups(size) for "
                        "groups by rank, or a topology with the same ranks on every node"
                    )
                )
            self._groups[key] = (self.split(color=topology.local_index(self.rank)),)
        return self._groups[key][0]

    def shard_groups(self, shard_size: int) -> tuple[Self, Self]:
        """Collective, the first time for each size: ``(shard, replica)`` communicators.

        ``shard``: the ranks r with the same r // shard_size (contiguous blocks of
        ``shard_size``); ``replica``: those with the same r % shard_size (one of each
        block), both in rank order. For N = R x S ranks, S = shard_size:

            N = 6, S = 3:  shard groups {0,1,2} {3,4,5}; replica groups {0,3} {1,4} {2,5}

        Kept as :meth:`intra_node` is; the same calling rule.
        """
        if (
            not isinstance(shard_size, int)
            or isinstance(shard_size, bool)
            or shard_size < 1
            or self.world_size % shard_size
        ):
            raise ValueError(
                self._err(
                    f"shard_groups: shard_size={shard_size!r} does not divide the "
                    f"{self.world_size} ranks; valid sizes: {divisors(self.world_size)}"
                )
            )
        key = ("shard_groups", shard_size)
        if key not in self._groups:
            shard = self.split(color=self.rank // shard_size)
            replica = self.split(color=self.rank % shard_size)
            self._groups[key] = (shard, replica)
        shard, replica = self._groups[key]
        return shard, replica
