"""Which reductions of a :class:`~zero_comm.communicator.Communicator` add the ranks'
contributions in rank order, and the rank-ordered all-reduce (zero_comm.ordered):

    op / dtype                 deterministic=True     deterministic=False
    MAX, MIN, integer SUM      native (exact anyway)  native
    float SUM, AVG             rank-ordered           native

unless the backend prefers the rank-ordered algorithm for that collective and dtype
(``_prefers_ordered``: where it is faster, or where the backend has no native reduction).

The rank-ordered all-reduce of n elements over N ranks pads to N*c (c = ceil(n/N)),
moves chunk r of every rank to rank r with one all-to-all, folds the N rows in rank order
there, and all-gathers the N folded chunks. The gather is a second collective issued
from the handle's completion, so the handle is queued (Communicator._pending) and its
phase keeps its place in the order on every rank (handle.py).
:class:`ReductionOrder` is a base of Communicator, as row_collectives.RowCollectives is.
"""

from __future__ import annotations

import abc
from collections import deque

import torch

from .buffers import BufferPool
from .handle import Handle, Work
from .ordered import chunk_numel, fold_rows
from .reduce_op import ReduceOp


class ReductionOrder(abc.ABC):
    """The choice of the rank-ordered algorithm, and the rank-ordered all-reduce."""

    world_size: int
    deterministic: bool
    buffers: BufferPool
    _pending: deque[Handle]

    @abc.abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _wait(self, work: Work, name: str) -> None: ...

    @abc.abstractmethod
    def _run_pending(self, until: Handle | None = None) -> None: ...

    def _prefers_ordered(self, collective: str, dtype: torch.dtype) -> bool:
        """Whether the rank-ordered algorithm is used even when not asked to be deterministic.

        Backends override this where the ordered algorithm is the faster one, or the only
        correct one (MPI has no bfloat16 type to reduce natively).
        """
        return False

    def _ordered(self, collective: str, op: ReduceOp, dtype: torch.dtype) -> bool:
        exact_in_any_order = op in (ReduceOp.MAX, ReduceOp.MIN) or not dtype.is_floating_point
        if self._prefers_ordered(collective, dtype):
            return True
        return self.deterministic and not exact_in_any_order

    def _ordered_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> Handle:
        n, size = flat.numel(), self.world_size
        chunk = chunk_numel(n, size)
        padded = chunk * size
        if padded == n:
            send = flat
        else:
            send = self.buffers.take(padded, flat.dtype)
            send[:n].copy_(flat)
            send[n:].zero_()
        rows = self.buffers.take(padded, flat.dtype)
        work = self._all_to_all(rows, send)

        def fold_then_gather() -> None:
            mine = self.buffers.take(chunk, flat.dtype)
            fold_rows(mine, rows.view(size, chunk), op)
            self._wait(self._all_gather(send, mine), "all_reduce (gather phase)")
            if send is not flat:
                flat.copy_(send[:n])
                self.buffers.give_back(send)
            self.buffers.give_back(mine)
            self.buffers.give_back(rows)

        handle = Handle(self, "all_reduce", work, fold_then_gather)
        self._pending.append(handle)  # its gather phase must keep its place in the order
        return handle
