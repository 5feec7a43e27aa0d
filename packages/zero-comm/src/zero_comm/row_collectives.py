"""Reductions over *rows*: each rank contributes several rows, not one tensor.

A world of N physical ranks can stand in for a world of V = sum(row_counts) *virtual*
ranks: physical rank i holds the rows of virtual ranks o_i .. o_i + c_i - 1, where
c_i = row_counts[i] and o_i = c_0 + ... + c_{i-1}. The row collectives give exactly what
the V-rank collective gives:

    all_reduce_rows(output, rows, row_counts)       rows (c_rank, n)    -> output n
    reduce_scatter_rows(output, rows, row_counts)   rows (c_rank, N*k)  -> output k (chunk rank)

Two ranks, row_counts (2, 1), one chunk of 2 elements per rank (k = 2):

    rank 0 rows   a0 a1 | a2 a3      (virtual rank 0)
                  b0 b1 | b2 b3      (virtual rank 1)
    rank 1 rows   c0 c1 | c2 c3      (virtual rank 2)
    reduce_scatter_rows: rank 0 gets (a0+b0)+c0, (a1+b1)+c1; rank 1 (a2+b2)+c2, ...

Deterministic (float SUM/AVG with ``deterministic=True``, as for the plain collectives):
the left fold over every rank's rows in (rank, row) order, ((r_0 + r_1) + r_2) + ..., in
the rows' dtype: the bits of the V-rank ``reduce_scatter``/``all_reduce`` and of one
process folding the V rows. It moves every rank's rows with one all-to-all, each rank
padded to m = max(row_counts) rows, so one rank sends (N-1)/N * m * N*k elements for a
reduce-scatter, m times the plain collective's bytes (m - c_rank rows of them zeros).
A caller that can pre-add rows it owns at the start of the fold (rank 0's block: its
partial sum is the fold's prefix) should send one row instead.

Otherwise (``deterministic=False``, MAX, MIN, integers): a rank first folds its own rows
(in row order), then the backend's native collective reduces the N partial results;
AVG divides by V, not N.

Stats record the bytes moved, under the plain collective that moves them: a
reduce_scatter of m*N*k elements (ordered) or N*k (native); all_reduce_rows ordered is a
reduce_scatter of m rows padded to N*ceil(n/N) plus an all_gather of those N*ceil(n/N),
native an all_reduce of n. The consistency check compares the row counts too (a crc32 in
the call's root field) so ranks that disagree on them raise CollectiveMismatchError.
:class:`RowCollectives` is a base of Communicator, like object_collectives.ObjectCollectives.
"""

from __future__ import annotations

import abc
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal, overload

import torch

from .buffers import BufferPool
from .call_check import DTYPE_CODE
from .handle import CompletedWork, Handle, Work
from .ordered import chunk_numel, fold_in_order
from .profiler_ranges import ranged
from .reduce_op import ReduceOp
from .stats import CommStats

# A rank's rows: one (c, n) tensor, or c tensors of n elements each (no stacking copy).
Rows = torch.Tensor | Sequence[torch.Tensor]


def row_counts_code(row_counts: Sequence[int]) -> int:
    """The row counts as one non-negative int for the consistency check."""
    return zlib.crc32(",".join(str(c) for c in row_counts).encode()) & 0x7FFFFFFF


def fold_ragged(
    out: torch.Tensor, blocks: torch.Tensor, row_counts: Sequence[int], op: ReduceOp
) -> None:
    """Fold ``blocks`` (shape (N, m, k): rank i's rows of this chunk, the first
    ``row_counts[i]`` of them real) into ``out`` (k elements) in (rank, row) order."""
    real = (row for rank, count in enumerate(row_counts) for row in blocks[rank, :count])
    fold_in_order(out, real, op)
    if op is ReduceOp.AVG:
        out.div_(sum(row_counts))


class RowCollectives(abc.ABC):
    """all_reduce_rows and reduce_scatter_rows over the communicator's primitives."""

    rank: int
    world_size: int
    buffers: BufferPool
    stats: CommStats
    _pending: deque[Handle]

    @abc.abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work: ...

    @abc.abstractmethod
    def _all_reduce_native(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _reduce_scatter_native(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp
    ) -> Work: ...

    @abc.abstractmethod
    def _wait(self, work: Work, name: str) -> None: ...

    @abc.abstractmethod
    def _run_pending(self, until: Handle | None = None) -> None: ...

    @abc.abstractmethod
    def _err(self, message: str) -> str: ...

    @abc.abstractmethod
    def _enter(
        self, name: str, describe: Callable[[], tuple[int, int, int, int]], label: str = ""
    ) -> None: ...

    @abc.abstractmethod
    def _check_tensor(self, name: str, role: str, tensor: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _check_op(self, name: str, op: ReduceOp, dtype: torch.dtype) -> None: ...

    @abc.abstractmethod
    def _ordered(self, collective: str, op: ReduceOp, dtype: torch.dtype) -> bool: ...

    @abc.abstractmethod
    def _complete(self, handle: Handle, async_op: bool) -> Handle | None: ...

    # ------------------------------------------------------------------ checks
    def _check_rows(
        self, name: str, output: torch.Tensor, rows: Rows, row_counts: Sequence[int]
    ) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """The row counts as a tuple and this rank's rows as a list of flat tensors."""
        counts = tuple(row_counts)
        if len(counts) != self.world_size or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts
        ):
            raise ValueError(
                self._err(
                    f"{name}: row_counts={counts!r} must hold one int >= 1 per rank "
                    f"({self.world_size} of them)"
                )
            )
        self._check_tensor(name, "output", output)
        if isinstance(rows, torch.Tensor):
            if rows.dim() != 2:
                raise ValueError(
                    self._err(f"{name}: rows must be 2-D (rows, n), got {tuple(rows.shape)}")
                )
            listed = list(rows)
        else:
            listed = [row.view(-1) for row in rows]
        if len(listed) != counts[self.rank]:
            raise ValueError(
                self._err(
                    f"{name}: this rank has row_counts[{self.rank}]={counts[self.rank]} rows "
                    f"to give, got {len(listed)}"
                )
            )
        for row in listed:
            self._check_tensor(name, "rows", row)
            if row.dtype != output.dtype or row.numel() != listed[0].numel():
                raise ValueError(
                    self._err(
                        f"{name}: rows must share the output's dtype {output.dtype} and one "
                        f"length; got {row.dtype} rows of {[r.numel() for r in listed]}"
                    )
                )
        return counts, listed

    # --------------------------------------------------------------- collectives
    @overload
    def reduce_scatter_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def reduce_scatter_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: Literal[True],
        label: str = ...,
    ) -> Handle: ...
    @overload
    def reduce_scatter_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: bool,
        label: str = ...,
    ) -> Handle | None: ...
    @ranged
    def reduce_scatter_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str = "",
    ) -> Handle | None:
        """``output`` on rank r = the reduction, over every rank's rows in (rank, row)
        order, of chunk r of the row. ``rows``: (row_counts[rank], world_size * k);
        ``output``: k elements. Equal to a reduce_scatter over sum(row_counts) ranks."""
        name = "reduce_scatter_rows"
        counts: tuple[int, ...] = ()
        listed: list[torch.Tensor] = []

        def describe() -> tuple[int, int, int, int]:
            nonlocal counts, listed
            counts, listed = self._check_rows(name, output, rows, row_counts)
            if listed[0].numel() != output.numel() * self.world_size:
                raise ValueError(
                    self._err(
                        f"{name}: each row must hold world_size={self.world_size} chunks of the "
                        f"output's {output.numel()} elements, got rows of {listed[0].numel()}"
                    )
                )
            self._check_op(name, op, output.dtype)
            return DTYPE_CODE[output.dtype], output.numel(), op.value, row_counts_code(counts)

        self._enter(name, describe, label)
        out = output.view(-1)
        return self._complete(self._rows_reduce_scatter(out, listed, counts, op, name), async_op)

    def _rows_reduce_scatter(
        self,
        out: torch.Tensor,
        rows: list[torch.Tensor],
        counts: tuple[int, ...],
        op: ReduceOp,
        name: str,
    ) -> Handle:
        """The reduce-scatter of ``rows`` into ``out`` (checked, agreed), recorded."""
        size, k, mine = self.world_size, out.numel(), counts[self.rank]
        if size == 1 or k == 0 or not self._ordered("reduce_scatter", op, out.dtype):
            self.stats.record("reduce_scatter", size * k, out.element_size())
            local = self.buffers.take(size * k, out.dtype)
            fold_in_order(local, rows, op)
            if size == 1 or k == 0:
                out.copy_(local[:k])
                self.buffers.give_back(local)
                if op is ReduceOp.AVG:
                    out.div_(sum(counts))
                return Handle(self, name, CompletedWork())
            native = ReduceOp.SUM if op is ReduceOp.AVG else op
            work = self._reduce_scatter_native(out, local, native)

            def finish_native() -> None:
                self.buffers.give_back(local)
                if op is ReduceOp.AVG:
                    out.div_(sum(counts))

            return Handle(self, name, work, finish_native)
        most = max(counts)
        self.stats.record("reduce_scatter", most * size * k, out.element_size())
        # send[r, s] = row s's chunk r: the all-to-all's chunk r is every row's chunk r.
        send = self.buffers.take(size * most * k, out.dtype)
        send_view = send.view(size, most, k)
        for s, row in enumerate(rows):
            send_view[:, s].copy_(row.view(size, k))
        if most > mine:
            send_view[:, mine:].zero_()
        received = self.buffers.take(size * most * k, out.dtype)
        work = self._all_to_all(received, send)

        def fold() -> None:
            fold_ragged(out, received.view(size, most, k), counts, op)
            self.buffers.give_back(send)
            self.buffers.give_back(received)

        return Handle(self, name, work, fold)

    @overload
    def all_reduce_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: Literal[False] = ...,
        label: str = ...,
    ) -> None: ...
    @overload
    def all_reduce_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: Literal[True],
        label: str = ...,
    ) -> Handle: ...
    @overload
    def all_reduce_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ...,
        *,
        async_op: bool,
        label: str = ...,
    ) -> Handle | None: ...
    @ranged
    def all_reduce_rows(
        self,
        output: torch.Tensor,
        rows: Rows,
        row_counts: Sequence[int],
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        label: str = "",
    ) -> Handle | None:
        """``output`` (n elements, every rank) = the reduction of every rank's rows
        ((row_counts[rank], n) here) in (rank, row) order: an all_reduce over
        sum(row_counts) ranks. ``output`` may be one of the rows' storage only if the
        rows are not read after the call starts (they are copied first)."""
        name = "all_reduce_rows"
        counts: tuple[int, ...] = ()
        listed: list[torch.Tensor] = []

        def describe() -> tuple[int, int, int, int]:
            nonlocal counts, listed
            counts, listed = self._check_rows(name, output, rows, row_counts)
            if listed[0].numel() != output.numel():
                raise ValueError(
                    self._err(
                        f"{name}: rows of {listed[0].numel()} elements for an output of "
                        f"{output.numel()}; they must be equal"
                    )
                )
            self._check_op(name, op, output.dtype)
            return DTYPE_CODE[output.dtype], output.numel(), op.value, row_counts_code(counts)

        self._enter(name, describe, label)
        flat, n, size = output.view(-1), output.numel(), self.world_size
        if size == 1 or n == 0 or not self._ordered("all_reduce", op, output.dtype):
            local = self.buffers.take(n, output.dtype)
            fold_in_order(local, listed, op)
            self.stats.record("all_reduce", n, output.element_size())
            flat.copy_(local)
            self.buffers.give_back(local)
            if size == 1 or n == 0:
                if op is ReduceOp.AVG:
                    flat.div_(sum(counts))
                return self._complete(Handle(self, name, CompletedWork()), async_op)
            native = ReduceOp.SUM if op is ReduceOp.AVG else op
            work = self._all_reduce_native(flat, native)

            def finish_native() -> None:
                if op is ReduceOp.AVG:
                    flat.div_(sum(counts))

            return self._complete(Handle(self, name, work, finish_native), async_op)
        chunk = chunk_numel(n, size)
        padded_rows = self.buffers.take(counts[self.rank] * chunk * size, output.dtype)
        padded_view = padded_rows.view(counts[self.rank], chunk * size)
        for s, row in enumerate(listed):
            padded_view[s, :n].copy_(row)
        padded_view[:, n:].zero_()
        mine = self.buffers.take(chunk, output.dtype)
        scatter = self._rows_reduce_scatter(mine, list(padded_view), counts, op, name)
        self.stats.record("all_gather", chunk * size, output.element_size())

        def fold_then_gather() -> None:
            scatter._complete()
            gathered = self.buffers.take(chunk * size, output.dtype)
            self._wait(self._all_gather(gathered, mine), "all_reduce_rows (gather phase)")
            flat.copy_(gathered[:n])
            for buffer in (gathered, mine, padded_rows):
                self.buffers.give_back(buffer)

        handle = Handle(self, name, CompletedWork(), fold_then_gather)
        self._pending.append(handle)  # its gather phase must keep its place in the order
        return self._complete(handle, async_op)
