"""A pool of reusable communication buffers.

Fresh allocations for every collective cost page faults (about 1-2 GB/s on small CPUs), so
staging buffers are taken from and given back to a pool. A buffer is a 1-D view of a cached
flat tensor of the same dtype and device, its capacity rounded up to a power of two.

Memory bound: when a request fits no free buffer, the free buffers of that dtype (all too
small) are dropped before a larger one is allocated. So, per dtype, the pool holds no more
than the largest set of buffers that were in flight at once, each rounded up to a power of
two.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Free lists of flat tensors keyed by dtype, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._in_flight: dict[int, torch.Tensor] = {}
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
            else:
                for outgrown in free:
                    self.bytes_held -= outgrown.numel() * outgrown.element_size()
                free.clear()
                capacity = 1 << max(numel - 1, 0).bit_length()
                chosen = torch.empty(capacity, dtype=dtype, device=self.device)
                self.bytes_held += chosen.numel() * chosen.element_size()
            self._in_flight[id(chosen)] = chosen
        return chosen[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer from :meth:`take`. Giving one back twice, or after :meth:`clear`,
        is ignored, so two later takes can never share memory."""
        base = buffer._base if buffer._base is not None else buffer
        with self._lock:
            if self._in_flight.pop(id(base), None) is None:
                return
            self._free.setdefault(base.dtype, []).append(base)

    def clear(self) -> None:
        """Forget every buffer; those in flight stay valid but are not taken back."""
        with self._lock:
            self._free.clear()
            self._in_flight.clear()
            self.bytes_held = 0
