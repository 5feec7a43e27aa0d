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
``madvise(MADV_DONTNEED)``). The engine calls it at the end of its build, and after an
optimizer step when resident memory has grown past what the first step left
(``StepHeapRelease``): a release is paid for with a page fault for each released page the
next step touches again, so a heap that the steps reuse as it is keeps its pages.

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


_MALLINFO2_FIELDS = (
    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
    "fordblks", "keepcost",
)  # fmt: skip


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: every field a size_t, in this order."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2`` (2.33 and later; its totals are over every arena), or None."""
    if _malloc_trim() is None:
        return None
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    info.argtypes = []
    info.restype = _MallInfo2
    return info


def heap_free_bytes() -> int | None:
    """Bytes in free heap chunks over every arena (resident or not), or None where glibc's
    ``mallinfo2`` is missing."""
    info = _mallinfo2()
    return int(info().fordblks) if info is not None else None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; True if any memory was released.

    Live allocations are untouched; a page released here costs a page fault (and the
    kernel's zeroing) when the heap next uses it."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


# The least growth of resident memory over the first step's that makes a step release.
MIN_GROWTH_BYTES = 64 << 20


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class StepHeapRelease:
    """Whether the free heap pages are given back after an optimizer step.

    Releasing costs a page fault and the kernel's zeroing for each released page that the
    next step touches again: at 19M parameters on 2 ranks, releasing after every step
    took 18-47 thousand page faults and 10-27 ms of ``malloc_trim`` per step; where the
    steps kept their pages, 0.2-3 thousand. A step that reuses the blocks the last one
    freed leaves resident memory level, and a release would only repay that price every
    step. So the resident bytes after the first step are the reference, and a later step
    releases only when they exceed it by more than max(reference / 8,
    MIN_GROWTH_BYTES) and the heap holds at least MIN_GROWTH_BYTES free: the heap has
    grown around freed blocks that are not being reused (at 101M on 4 ranks, by about
    500 MiB a step, docs/stage3-memory.md). The heap's free bytes alone cannot tell: they
    count released pages too, which a step can make resident again without changing them.
    Where resident or free bytes cannot be read, every step releases.
    """

    def __init__(self) -> None:
        self.reference: int | None = None
        self.releases = 0

    def limit(self) -> int | None:
        """Resident bytes above which a step releases (None before the first step)."""
        if self.reference is None:
            return None
        return self.reference + max(self.reference // 8, MIN_GROWTH_BYTES)

    def after_step(self) -> bool:
        """Release if resident memory has grown (see the class); True if it did."""
        resident, free = resident_bytes(), heap_free_bytes()
        if resident is not None and free is not None:
            if self.reference is None:
                self.reference = resident
                return False
            limit = self.limit()
            if limit is not None and (resident <= limit or free < MIN_GROWTH_BYTES):
                return False
        self.releases += 1
        return release_free_heap()
