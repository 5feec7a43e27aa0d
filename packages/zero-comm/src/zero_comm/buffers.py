"""A pool of reusable communication buffers.

Fresh allocations for every collective cost page faults (about 1-2 GB/s on small CPUs), so
staging buffers are taken from and returned to a pool. A buffer is a 1-D view of a cached
flat tensor of the same dtype and device; the pool never holds more than the peak of buffers
in flight at once, rounded up to powers of two.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Grow-only free lists of flat tensors keyed by (dtype, device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes_held = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements; its contents are undefined."""
        with self._lock:
            free = self._free.setdefault(dtype, [])
            fitting = [i for i, t in enumerate(free) if t.numel() >= numel]
            if fitting:
                # list.remove would compare tensors elementwise; pop by position instead.
                chosen = free.pop(min(fitting, key=lambda i: free[i].numel()))
                return chosen[:numel]
        capacity = 1 << max(numel - 1, 0).bit_length()
        storage = torch.empty(capacity, dtype=dtype, device=self.device)
        with self._lock:
            self.bytes_held += storage.numel() * storage.element_size()
        return storage[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        base = buffer._base if buffer._base is not None else buffer
        with self._lock:
            self._free.setdefault(base.dtype, []).append(base)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.bytes_held = 0
