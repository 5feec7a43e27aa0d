"""Which ranks of a communicator share a node, and how the world's nodes are found.

A :class:`Topology` gives the node of every rank of one communicator. Nodes are numbered
0, 1, ... in order of first appearance in the world; a sub-communicator keeps the world's
node numbers for its members, so ``node_of`` there need not start at 0 nor be contiguous:

    world, 2 nodes x 3 ranks     node_of = (0, 0, 0, 1, 1, 1)
    its split of ranks 2, 3, 5   node_of = (0, 1, 1)

At ``zero_comm.init`` every rank states what it knows about its node (a
:class:`NodeEvidence`), the ranks all-gather it, and :func:`topology_from_evidence` picks the
first source that every rank can answer alike, so all ranks agree on the result:

    source               where the node comes from
    argument             init(ranks_per_node=k): ranks 0..k-1 on node 0, k..2k-1 on node 1, ...
    ZERO_RANKS_PER_NODE  the same, from the environment variable
    torchrun             GROUP_RANK (or RANK - LOCAL_RANK, see below)
    openmpi              OMPI_COMM_WORLD_RANK - OMPI_COMM_WORLD_LOCAL_RANK (see below)
    mpich                PMI_RANK - MPI_LOCALRANKID (MPICH and Intel MPI; see below)
    slurm                SLURM_NODEID (srun)
    mpi-shared-memory    the mpi backend's MPI_Comm_split_type(COMM_TYPE_SHARED)
    hostname             socket.gethostname()
    single-node          one rank; or a communicator nobody told otherwise

MPI launchers name a rank's place on its node (local rank and local size) but no node: the
node is then taken to start at world rank ``rank - local_rank``, which holds when each node
holds a contiguous block of ranks (the default mapping of mpiexec and mpirun). The gathered
answers show whether it held: every node must then be ranks k..k+L-1 with local ranks
0..L-1 and local size L. A round-robin mapping fails that check, and the next source is
used instead, never a wrong topology.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from .launcher_env import NodeKey

log = logging.getLogger(__name__)

SOURCES = (
    "argument", "ZERO_RANKS_PER_NODE", "torchrun", "openmpi", "mpich", "slurm",
    "mpi-shared-memory", "hostname", "single-node",
)  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """The node of each rank of one communicator.

    Attributes:
        node_of: ``node_of[r]`` is the node of rank ``r`` of this communicator, in the
            world's numbering (0, 1, ... by first appearance in the world).
        source: where the world learnt it (one of :data:`SOURCES`); not compared by ``==``.
    """

    node_of: tuple[int, ...]
    source: str = field(default="argument", compare=False)

    def __post_init__(self) -> None:
        node_of = tuple(self.node_of)
        object.__setattr__(self, "node_of", node_of)
        if not node_of:
            raise ValueError("Topology: node_of is empty; a communicator has at least one rank")
        bad = [n for n in node_of if not isinstance(n, int) or isinstance(n, bool) or n < 0]
        if bad:
            raise ValueError(f"Topology: node indices must be ints >= 0, got {bad[0]!r}")
        if self.source not in SOURCES:
            raise ValueError(f"Topology: source={self.source!r} is not one of {SOURCES}")

    # -------------------------------------------------------------- constructors
    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int, source: str = "argument") -> Topology:
        """Node-major blocks: rank ``r`` on node ``r // ranks_per_node``."""
        for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.uniform: {name} must be an int >= 1, got {value!r}")
        if world_size % ranks_per_node:
            raise ValueError(
                f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}; "
                f"use one of {divisors(world_size)} (every node holds the same number of ranks)"
            )
        return cls(tuple(r // ranks_per_node for r in range(world_size)), source)

    @classmethod
    def single_node(cls, world_size: int, source: str = "single-node") -> Topology:
        """Every rank on node 0."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Topology.single_node: world_size must be >= 1, got {world_size!r}")
        return cls((0,) * world_size, source)

    @classmethod
    def from_keys(cls, keys: Sequence[object], source: str) -> Topology:
        """Ranks with equal keys share a node; nodes are numbered by first appearance."""
        index: dict[object, int] = {}
        return cls(tuple(index.setdefault(key, len(index)) for key in keys), source)

    def restrict(self, parent_ranks: Sequence[int]) -> Topology:
        """The topology of a sub-communicator whose rank ``i`` is rank ``parent_ranks[i]``
        here: the same node numbers, the same source."""
        return Topology(tuple(self.node_of[p] for p in parent_ranks), self.source)

    # ---------------------------------------------------------------- questions
    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node indices present, in order of their first rank."""
        return tuple(dict.fromkeys(self.node_of))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int | None:
        """The number of ranks on each node, or None where nodes hold unequal numbers."""
        counts = {self.node_of.count(node) for node in self.nodes}
        return counts.pop() if len(counts) == 1 else None

    def same_node(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` of this communicator share a node."""
        return self.node_of[a] == self.node_of[b]

    def local_ranks(self, node: int) -> tuple[int, ...]:
        """The ranks of this communicator on ``node``, in rank order."""
        if node not in self.node_of:
            raise ValueError(
                f"Topology: no rank of this communicator is on node {node}; its nodes are "
                f"{list(self.nodes)}"
            )
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def local_index(self, rank: int) -> int:
        """The position of ``rank`` among the ranks of its node (0 for the lowest)."""
        return self.local_ranks(self.node_of[rank]).index(rank)

    def __str__(self) -> str:
        per_node = self.ranks_per_node
        shape = f"{self.num_nodes} x {per_node}" if per_node else f"nodes {list(self.node_of)}"
        return f"{self.world_size} ranks on {self.num_nodes} node(s) ({shape}, {self.source})"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the valid group sizes of ``n`` ranks)."""
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ detection


@dataclass(frozen=True)
class NodeEvidence:
    """What one rank knows about its node; all-gathered at init, then decided alike.

    ``ranks_per_node`` is ZERO_RANKS_PER_NODE as set (unparsed, so that a bad value raises
    on every rank, after the gather, rather than on one rank before it).
    """

    ranks_per_node: str | None
    launcher: NodeKey | None
    shared_memory: int | None
    hostname: str


def topology_from_evidence(evidence: Sequence[NodeEvidence]) -> Topology:
    """The world's topology from every rank's evidence (index = world rank).

    Raises ValueError where ZERO_RANKS_PER_NODE is malformed or differs between ranks.
    """
    size = len(evidence)
    declared = {e.ranks_per_node for e in evidence}
    if declared != {None}:
        if len(declared) > 1:
            seen = {r: e.ranks_per_node for r, e in enumerate(evidence)}
            raise ValueError(
                f"ZERO_RANKS_PER_NODE differs between ranks ({seen}); set it alike on every "
                "node, or unset it to detect the nodes"
            )
        raw = declared.pop()
        try:
            per_node = int(raw or "")
        except ValueError:
            raise ValueError(f"ZERO_RANKS_PER_NODE={raw!r} is not an integer") from None
        return Topology.uniform(size, per_node, "ZERO_RANKS_PER_NODE")
    if size == 1:
        return Topology.single_node(1)
    keys = [e.launcher for e in evidence]
    from_launcher = _from_launcher_keys(keys)
    if from_launcher is not None:
        return from_launcher
    shared = [e.shared_memory for e in evidence]
    if all(k is not None for k in shared):
        return Topology.from_keys(shared, "mpi-shared-memory")
    return Topology.from_keys([e.hostname for e in evidence], "hostname")


def _from_launcher_keys(keys: Sequence[NodeKey | None]) -> Topology | None:
    """The topology the launcher's variables describe, or None where they do not describe
    one consistently (absent on some rank, another launcher's, a non-contiguous mapping)."""
    present = [k for k in keys if k is not None]
    if not present:
        return None
    sources = {k.source for k in present}
    if len(present) < len(keys) or len(sources) > 1:
        log.warning(
            "zero_comm: the ranks' launcher variables disagree (%s); finding nodes another way",
            sorted(sources | ({"none"} if len(present) < len(keys) else set())),
        )
        return None
    members: dict[int, list[int]] = {}
    for rank, key in enumerate(present):
        members.setdefault(key.node, []).append(rank)
    for node, ranks in members.items():
        if not _consistent(node, ranks, [present[r] for r in ranks]):
            log.info(
                "zero_comm: the %s variables do not describe node-contiguous blocks of ranks "
                "(ranks %s); finding nodes another way",
                present[0].source,
                ranks,
            )
            return None
    return Topology.from_keys([k.node for k in present], present[0].source)


def _consistent(node: int, ranks: list[int], keys: list[NodeKey]) -> bool:
    """Whether the ranks claiming ``node`` agree with their own local ranks and sizes."""
    sizes = {k.local_size for k in keys} - {None}
    if len(sizes) > 1 or (sizes and sizes.pop() != len(ranks)):
        return False
    if keys[0].from_local_rank:
        if any(k.local_size is None for k in keys):
            return False  # without the node's size, a block cannot be told complete
        # node = the node's first world rank: ranks node..node+L-1, local ranks 0..L-1.
        return ranks == list(range(node, node + len(ranks))) and [
            k.local_rank for k in keys
        ] == list(range(len(ranks)))
    return True
