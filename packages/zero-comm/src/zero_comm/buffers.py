"""A pool of reusable communication buffers.

Fresh allocations for every collective cost page faults (about 1-2 GB/s on small CPUs), so
staging buffers are taken from and given back to a pool. A buffer is a 1-D view of a cached
flat tensor of the same dtype and device, its capacity rounded up to its *size class*:
eight classes per power of two, so a buffer is at most 1/8 larger than asked for, and the
sizes a training step asks for (bucket_numel, a bucket's padded size, a rank's slice:
small multiples of a power of two) fit their class exactly:

    numel in (2^(k-1), 2^k]  ->  capacity = numel rounded up to a multiple of 2^(k-4)
    3 * 2^20 -> 3 * 2^20 (exact);  2^20 + 1 -> 2^20 + 2^17;  (a power of two would be 2^21)

Memory bound: when a request fits no free buffer, the free buffers of that dtype (all too
small) are dropped before a larger one is allocated. So, per dtype, the pool holds no more
than the largest set of buffers that were in flight at once, each rounded up to its size
class. :meth:`release_free` drops every free buffer: a caller that knows the buffers will
idle for a while (stage 3 after backward: forward and the optimizer step use none) calls
it, so they do not add to the peak of those phases.
"""

from __future__ import annotations

import threading

import torch

CLASSES_PER_OCTAVE = 8  # capacity overhead < 1 / CLASSES_PER_OCTAVE


def size_class(numel: int) -> int:
    """The capacity, in elements, of the storage the pool allocates for ``numel``: the
    next multiple of 2^(k-4) at or above ``numel``, where 2^(k-1) < numel <= 2^k (and 1
    for 0: an empty request still gets storage of its own, with an address of its own)."""
    if numel <= 1:
        return 1
    granule = 1 << max(0, (numel - 1).bit_length() - CLASSES_PER_OCTAVE.bit_length())
    return -(-numel // granule) * granule


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
                self._drop(free)  # all too small
                chosen = torch.empty(size_class(numel), dtype=dtype, device=self.device)
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

    def release_free(self) -> None:
        """Drop every free buffer (their memory goes back to the allocator now); buffers
        in flight stay in the pool and come back to it as usual."""
        with self._lock:
            for free in self._free.values():
                self._drop(free)

    def _drop(self, free: list[torch.Tensor]) -> None:
        """Forget the free buffers of ``free`` (one dtype's list), held under the lock."""
        for buffer in free:
            self.bytes_held -= buffer.numel() * buffer.element_size()
        free.clear()

    def clear(self) -> None:
        """Forget every buffer; those in flight stay valid but are not taken back."""
        with self._lock:
            self._free.clear()
            self._in_flight.clear()
            self.bytes_held = 0
