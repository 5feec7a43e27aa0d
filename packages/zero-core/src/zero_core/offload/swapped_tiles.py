"""The disk tier of the master weights and optimizer states: one swap file per tile and
state, streamed through a fixed set of buffers (ZeRO-Infinity's sub-group pipeline).

    offload_dir/zero-swap-rank{r}/g{group}.t{tile}.{first parameter}.{key}.swap
        key "master" (float32), each optimizer state as large as the tile (exp_avg, ...),
        and "gradient" (the gradient dtype) when gradients are offloaded: written as the
        tile's reduced slice lands (gradient_tier), read with the master and states

The step visits the tiles in order through ``offload_buffer_count`` (B) buffers:

    buffer    0        1        2        3        0 ...
    tile      k-1      k        k+1      k+2
              writing  stepping reading  reading        (reads run B-2 tiles ahead)

Reads and writes run on a pool of ``offload_io_threads`` threads (os.pread/os.pwrite,
O_DIRECT where the filesystem allows it, see swap_file); a buffer is read into only after
the write of its previous tile finished. Every block carries a checksum: a torn or
changed swap file raises CorruptSwapError naming it and is never stepped on. Swap files
are scratch: they are removed at close, and a run resumes from its last checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from zero_comm.profiler_ranges import profiler_range

from .swap_file import SwapFile, aligned_empty
from .tiers import TileSpec

MASTER = "master"
GRAD = "gradient"


class ResidentTile:
    """One tile's values while it is in a buffer: ``master`` and the swapped ``states``
    (views of the buffer, ``numel`` elements each)."""

    def __init__(
        self, owner: SwappedTiles, index: int, buffer: dict[str, torch.Tensor], states: bool,
        gradient: bool = False,
    ) -> None:  # fmt: skip
        self._owner = owner
        self._buffer = buffer
        self.index = index
        self.numel = owner.specs[index].numel
        self.master = buffer[MASTER][: self.numel]
        keys = owner.keys[index] if states else []
        self.states = {key: buffer[key][: self.numel] for key in keys}
        # This step's gradient of the tile, in the gradient dtype, as it was accumulated
        # (read-only: it is not written back); None when not read.
        self.gradient = buffer[GRAD][: self.numel] if gradient else None

    def keep(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """Make ``value`` (a state as large as the tile) part of what is written back;
        returns the buffer view that now holds it."""
        view = self._owner.buffer_view(self._buffer, key, value.dtype, self.numel)
        if view.data_ptr() != value.data_ptr():
            view.copy_(value.reshape(-1))
        if key not in self._owner.keys[self.index]:
            self._owner.keys[self.index].append(key)
        self.states[key] = view
        return view


class SwappedTiles:
    """The disk tiles of one rank; see the module docstring."""

    def __init__(
        self,
        specs: list[TileSpec],
        labels: list[str],
        folder: Path,
        *,
        buffer_count: int,
        io_threads: int,
    ) -> None:
        self.specs = specs
        self.labels = labels
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.keys: list[list[str]] = [[] for _ in specs]  # swapped states of each tile
        self.scalars: list[dict[str, Any]] = [{} for _ in specs]  # Adam's step, ...
        self._files: list[dict[str, SwapFile]] = [{} for _ in specs]
        self._dtypes: list[dict[str, torch.dtype]] = [{} for _ in specs]
        self._max_numel = max((spec.numel for spec in specs), default=0)
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(buffer_count)]
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="zero-swap")
        # Per tile: whether this step's gradient is in its GRAD block (gradient_tier).
        self.gradient_landed = [False] * len(specs)
        self.bytes_read = 0
        self.bytes_written = 0

    # ----------------------------------------------------------------- files
    def _file(self, index: int, key: str, dtype: torch.dtype) -> SwapFile:
        files = self._files[index]
        if key not in files:
            spec = self.specs[index]
            name = f"g{spec.group}.t{index:05d}.{self.labels[index]}.{key}.swap"
            itemsize = dtype.itemsize
            files[key] = SwapFile(self.folder / name, spec.numel * itemsize)
            self._dtypes[index][key] = dtype
        return files[key]

    def write(self, index: int, key: str, value: torch.Tensor) -> None:
        self._file(index, key, value.dtype).write(0, value, key)
        self.bytes_written += value.numel() * value.element_size()

    def read(self, index: int, key: str, out: torch.Tensor) -> None:
        self._file(index, key, out.dtype).read(0, out, key)
        self.bytes_read += out.numel() * out.element_size()

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for files in self._files for f in files.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._buffers for t in b.values())

    def buffer_view(
        self, buffer: dict[str, torch.Tensor], key: str, dtype: torch.dtype, numel: int
    ) -> torch.Tensor:
        if key not in buffer or buffer[key].dtype != dtype:
            buffer[key] = aligned_empty(self._max_numel, dtype)
        return buffer[key][:numel]

    # -------------------------------------------------------------- pipeline
    def stream(
        self, visit: Callable[[ResidentTile], None], *, write: bool, states: bool,
        gradients: bool = False,
    ) -> None:  # fmt: skip
        """Call ``visit`` on every tile in order, each resident in a buffer (its master,
        and its states when ``states``, and with ``gradients`` its gradient block where
        this step's gradient landed in one), reading ahead and, with ``write``, writing
        back behind (masters and states; never the gradient); see the module docstring.
        Returns when every write has landed."""
        count, slots = len(self.specs), len(self._buffers)
        reads: dict[int, list[Future[None]]] = {}
        writes: dict[int, list[Future[None]]] = {}

        def start_reads(index: int) -> None:
            with profiler_range("swap.write.wait"):
                for future in writes.pop(index - slots, []):
                    future.result()  # that buffer's previous tile has landed
            buffer = self._buffers[index % slots]
            numel = self.specs[index].numel
            keys = [MASTER, *(self.keys[index] if states else [])]
            if gradients and self.gradient_landed[index]:
                keys.append(GRAD)
            reads[index] = [
                self._pool.submit(
                    self.read,
                    index,
                    key,
                    self.buffer_view(
                        buffer,
                        key,
                        torch.float32 if key == MASTER else self.dtype_of(index, key),
                        numel,
                    ),
                )
                for key in keys
            ]

        ahead = max(1, slots - 2)
        started = 0
        try:
            for index in range(count):
                while started < count and started <= index + ahead - 1:
                    start_reads(started)
                    started += 1
                with profiler_range("swap.read.wait"):
                    for future in reads.pop(index):
                        future.result()
                tile = ResidentTile(
                    self, index, self._buffers[index % slots], states,
                    gradients and self.gradient_landed[index],
                )  # fmt: skip
                visit(tile)
                if write:
                    writes[index] = [self._pool.submit(self.write, index, MASTER, tile.master)]
                    writes[index] += [
                        self._pool.submit(self.write, index, key, view)
                        for key, view in tile.states.items()
                    ]
        finally:
            pending = [f for fs in (*reads.values(), *writes.values()) for f in fs]
            with profiler_range("swap.write.wait"):
                errors = [f.exception() for f in pending]  # waits for each
        for error in errors:
            if error is not None:
                raise error

    def dtype_of(self, index: int, key: str) -> torch.dtype:
        return self._dtypes[index].get(key, torch.float32)

    def close(self) -> None:
        """Stop the I/O threads and remove the swap files (they are scratch)."""
        self._pool.shutdown(wait=True)
        for files in self._files:
            for swap in files.values():
                swap.remove()
        shutil.rmtree(self.folder, ignore_errors=True)
