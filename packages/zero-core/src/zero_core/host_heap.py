"""Giving the C heap's free pages back to the system after the build and after each step.

Why. On a CPU device torch allocates tensors with ``posix_memalign``. glibc serves a
block below its mmap threshold from the heap, and raises that threshold (up to 32 MiB)
each time it unmaps a larger block, so after the first freed bucket-sized tensor every
gradient, gathered parameter and activation of a ZeRO step comes from the heap. Freed
heap blocks stay resident as long as a live block lies above them, and the heap only
shrinks from its top:

    heap   | live | free (resident) | live | free (resident) ....... | live |  <- top
                    ^ pages nobody uses, still counted in the process's RSS

How much stays depends on the order in which blocks are freed, which depends on thread
timing. At 101M parameters on 4 ranks, stage 3 on a communicator split from the world
(as the benchmark and any tensor x data-parallel mesh make one), the heap grew by about
500 MiB a step while its bytes in use stayed constant (docs/stage3-memory.md).
``malloc_trim(0)`` returns the free pages anywhere in the heap (glibc >= 2.8,
``madvise(MADV_DONTNEED)``), so calling it at the end of the build and of each optimizer
step bounds the resident heap by what one step needs.

Where the C library is not glibc (musl, macOS, Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS,
    Windows). The process's own symbols first: ``find_library`` needs ldconfig or a
    compiler, which a slim glibc image may lack."""
    names: list[str | None] = [None] if os.name == "posix" else []  # None: loaded symbols
    found = ctypes.util.find_library("c")
    if found is not None:
        names.append(found)
    for name in names:
        try:
            trim = ctypes.CDLL(name).malloc_trim
        except (OSError, AttributeError, TypeError):
            continue
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        return trim
    return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; True if any memory was released.

    Live allocations are untouched; a page released here costs a page fault (and the
    kernel's zeroing) when the heap next uses it."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
