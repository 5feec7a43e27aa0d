"""Blocks written piece by piece and sent on (to a swap file) as soon as they are whole.

Initial values arrive one parameter at a time, and updated masters one tile at a time; a
swapped block (a bucket slice, a tile) needs all its elements before it is written. A
block's buffer exists from its first piece until its last expected element arrived,
so what is held at once is the blocks being filled, never the whole shard:

    block 7  expected 1000   pieces [0, 600) [600, 1000)  -> flushed at the second piece
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from .swap_file import aligned_empty

Flush = Callable[[Hashable, torch.Tensor], None]


class PartialBlocks:
    """Buffers of blocks being filled; ``flush(key, buffer)`` when one is complete."""

    def __init__(
        self, numels: dict[Hashable, int], expected: dict[Hashable, int], dtype: torch.dtype,
        flush: Flush,
    ) -> None:  # fmt: skip
        self.numels = numels  # each block's length (padding included)
        self.expected = expected  # elements written before a block is complete
        self.dtype = dtype
        self.flush = flush
        # Aligned, so a direct write needs no bounce buffer (swap_file).
        self._open: dict[Hashable, tuple[torch.Tensor, int]] = {}
        self._done: set[Hashable] = set()

    def write(self, key: Hashable, offset: int, values: torch.Tensor) -> None:
        """Elements [offset, offset + len(values)) of block ``key``."""
        if key in self._done:
            raise RuntimeError(
                f"block {key} was written out already and is written again: a bug in the "
                "engine's offload bookkeeping"
            )
        buffer, count = self._open.get(key, (None, 0))
        if buffer is None:
            buffer = aligned_empty(self.numels[key], self.dtype).zero_()
        buffer[offset : offset + values.numel()] = values.reshape(-1)
        count += values.numel()
        if count >= self.expected[key]:
            self._open.pop(key, None)
            self._done.add(key)
            self.flush(key, buffer)
        else:
            self._open[key] = (buffer, count)

    def finish(self) -> None:
        """Flush every block not yet flushed (zeros where nothing was written: padding),
        then start over for the next round."""
        for key in self.numels:
            if key not in self._done:
                buffer, _ = self._open.pop(key, (None, 0))
                if buffer is None:
                    buffer = aligned_empty(self.numels[key], self.dtype).zero_()
                self.flush(key, buffer)
        self._done.clear()

    @property
    def open_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b, _ in self._open.values())
