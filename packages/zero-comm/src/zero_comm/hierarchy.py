"""Hybrid groups: N = R x S ranks as R replicas of a shard group of S ranks, and a
gradient reduction across both whose sum does not depend on the grouping.

    world ranks (R = 2, S = 3):   shard group 0: 0 1 2 | shard group 1: 3 4 5
    replica groups:               {0, 3}  {1, 4}  {2, 5}        (same shard rank)

Shard groups are blocks of S consecutive ranks, so with node-major rank numbering (what
every launcher does) a shard group of one node's ranks stays inside the node and only
the replica groups cross nodes.

The order of the sum. A flat deterministic reduce-scatter over N ranks gives every
element the left fold in world rank order, ((x_0 + x_1) + x_2) + ... + x_{N-1}, each
partial sum rounded to the dtype. No tree of partial sums can equal that fold for every
factorisation (for N = 6, S = 3 needs {0,1,2} as a subtree and S = 2 needs {2,3}), so the
exact reduction carries the fold itself across the replicas, as a chain:

    1. all_to_all in the shard group: shard rank s gets the S rows of its chunk,
       one per member, in rank order (intra-group, (S-1)/S of the bucket per rank).
    2. replica 0 folds its S rows; replica j receives the partial sum from replica j-1,
       adds its own S rows onto it in order, and passes it on (replica links, one
       chunk per hop).
    3. the last replica holds the fold over all N ranks, in world rank order; it is
       broadcast back over the replica group.

Every element goes through exactly the additions of the flat fold, so the result equals
the flat reduce-scatter (and stage 0's all-reduce) bit for bit, at every R x S. The cost
against the native hierarchical sum (reduce-scatter in the group, all-reduce of the
chunk across replicas): the same bytes per rank on the replica links when R = 2 (a chunk
each way), about 2 chunks instead of 2 (R-1)/R for larger R, and the hops run one after
another (pipelined in pieces of ``piece_numel``, so a hop's transfer overlaps the next
piece's). With ``deterministic=False`` the native sum is used.
"""

from __future__ import annotations

from typing import Literal

import torch

from .communicator import Communicator
from .handle import CompletedWork, Handle
from .ordered import fold_rows
from .reduce_op import ReduceOp

DEFAULT_PIECE_NUMEL = 1 << 20


class HybridGroups:
    """The shard and replica groups of ``world`` for a shard group of ``shard_size`` ranks.

    Collective to build (``world.shard_groups``, then the hop pairs). Attributes: ``world``,
    ``shard`` (this rank's shard group; its rank is the shard rank ``world.rank % S``),
    ``replica`` (the ranks with this shard rank; its rank is the replica index
    ``world.rank // S``), ``shard_size`` (S) and ``replicas`` (R).
    """

    def __init__(
        self, world: Communicator, shard_size: int, *, piece_numel: int = DEFAULT_PIECE_NUMEL
    ) -> None:
        n = world.world_size
        if not isinstance(shard_size, int) or shard_size < 1 or n % shard_size:
            valid = [d for d in range(1, n + 1) if n % d == 0]
            raise ValueError(
                f"shard group size {shard_size!r} does not divide the {n} ranks; use one of {valid}"
            )
        self.world = world
        self.shard_size = shard_size
        self.replicas = n // shard_size
        self.piece_numel = max(1, piece_numel)
        self.shard, self.replica = world.shard_groups(shard_size)
        j = self.replica.rank
        # The hop j -> j+1 runs on a two-rank group of its own, so a rank's receive (from
        # j-1) and send (to j+1) are on different groups and may be in flight together,
        # and neither queues behind the final broadcast on ``replica``.
        even = world.split(color=(world.rank % shard_size) * n + j // 2)
        odd = world.split(color=(world.rank % shard_size) * n + (j + 1) // 2)
        self._from_previous = odd if j % 2 == 0 else even  # hop j-1 -> j
        self._to_next = even if j % 2 == 0 else odd  # hop j -> j+1

    @property
    def deterministic(self) -> bool:
        return self.world.deterministic

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: Literal[True] = True,
        label: str = "",
    ) -> Handle:
        """``output`` on shard rank s = the sum over all N world ranks of chunk s of
        ``input`` (S chunks), in world rank order when the world is deterministic.

        Always asynchronous: the shard-group exchange is launched now, the replica hops
        run in the handle's ``wait()``."""
        if op is not ReduceOp.SUM:
            raise ValueError(f"hybrid reduce_scatter supports SUM only, got {op}")
        if self.replicas == 1:
            return self.shard.reduce_scatter(output, input, async_op=True, label=label)
        if not self.deterministic:
            return self._native(output, input, label)
        rows = self.shard.buffers.take(input.numel(), input.dtype)
        exchange = self.shard.all_to_all(rows, input, async_op=True, label=label)

        def chain() -> None:
            exchange.wait()
            self._fold_along_replicas(output.view(-1), rows.view(self.shard_size, -1), label)
            self.shard.buffers.give_back(rows)

        return Handle(self.shard, "reduce_scatter", CompletedWork(), chain)

    def _native(self, output: torch.Tensor, input: torch.Tensor, label: str) -> Handle:
        inner = self.shard.reduce_scatter(output, input, async_op=True, label=label)

        def across() -> None:
            inner.wait()
            self.replica.all_reduce(output, label=label)

        return Handle(self.shard, "reduce_scatter", CompletedWork(), across)

    def _fold_along_replicas(self, out: torch.Tensor, rows: torch.Tensor, label: str) -> None:
        """Steps 2 and 3 of the module docstring, piece by piece."""
        j, last = self.replica.rank, self.replicas - 1
        pieces = [
            (a, min(a + self.piece_numel, out.numel()))
            for a in range(0, out.numel(), self.piece_numel)
        ]
        received: list[Handle] = []
        if j > 0:  # every receive is posted first; they complete in order
            for a, b in pieces:
                received.append(
                    self._from_previous.broadcast(
                        out[a:b], src=0, async_op=True, label=f"{label} hop {j - 1}->{j}"
                    )
                )
        outgoing: list[Handle] = []
        for k, (a, b) in enumerate(pieces):
            acc = out[a:b]
            if j == 0:
                fold_rows(acc, rows[:, a:b], ReduceOp.SUM)
            else:
                received[k].wait()
                for row in rows[:, a:b]:
                    acc.add_(row)
            if j < last:
                hop = f"{label} hop {j}->{j + 1}"
                outgoing.append(self._to_next.broadcast(acc, src=0, async_op=True, label=hop))
        for handle in outgoing:
            handle.wait()
        results = [
            self.replica.broadcast(out[a:b], src=last, async_op=True, label=f"{label} result")
            for a, b in pieces
        ]
        for handle in results:
            handle.wait()


def hierarchical_all_gather(
    group: Communicator, output: torch.Tensor, input: torch.Tensor, *, label: str = ""
) -> Handle:
    """``group.all_gather(output, input)`` in two hops (MiCS's hierarchical gather):
    across nodes first, among the ranks with this local index, then inside each node.

        group of k nodes x P ranks, part (m, l) = input of the rank l of node m
        hop 1 (inter-node): rank (m, l) gets (0, l) (1, l) ... (k-1, l)
        hop 2 (intra-node): rank gets those k parts of every l, ordered (l, m)
        reorder to (m, l): output = the group's rank order, as one all_gather

    Nothing is reduced, so the bits equal the flat all_gather's. Needs equal ranks per
    node in ``group`` (nodes of consecutive ranks); falls back to the flat gather when
    ``group`` is inside one node. Hop 1 is launched now, hop 2 runs in ``wait()``.
    """
    topology = group.topology
    if topology.num_nodes == 1 or group.world_size == topology.num_nodes:
        return group.all_gather(output, input, async_op=True, label=label)
    per_node = topology.ranks_per_node
    if per_node is None:
        raise ValueError(
            group._err(
                f"hierarchical all_gather: the group's nodes hold unequal numbers of ranks "
                f"({topology}); use the flat all_gather"
            )
        )
    nodes, part = topology.num_nodes, input.numel()
    inter, intra = group.inter_node(), group.intra_node()  # made on the first call
    across = group.buffers.take(nodes * part, input.dtype)
    first = inter.all_gather(across, input, async_op=True, label=f"{label} across")

    def inside() -> None:
        first.wait()
        gathered = group.buffers.take(per_node * nodes * part, input.dtype)
        intra.all_gather(gathered, across, label=f"{label} inside")
        reordered = gathered.view(per_node, nodes, part).transpose(0, 1)
        output.view(nodes, per_node, part).copy_(reordered)
        group.buffers.give_back(gathered)
        group.buffers.give_back(across)

    return Handle(group, "all_gather", CompletedWork(), inside)
