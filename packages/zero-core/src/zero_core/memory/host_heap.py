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
500 MiB a step while its bytes in use stayed constant (docs/stage3-memory.md). Most of
that growth was torch's flight recorder, whose per-collective entries pinned the holes
(zero_comm keeps it off: zero_comm/flight_recorder.py); without it the heap still holds
up to ~500 MiB free at that size, from the dynamic threshold above.
``malloc_trim(0)`` returns the free pages anywhere in the heap (glibc >= 2.8,
``madvise(MADV_DONTNEED)``). The engine calls it at the end of its build and of its first
two optimizer steps, and after a later step when the heap has grown (``StepHeapRelease``):
a release is paid for with a page fault for each released page the next step touches
again, so a heap that the steps reuse as it is keeps its pages.

Where the C library is not glibc (musl, macOS, Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable

from .proc_status import process_status_kib


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


def heap_bytes() -> tuple[int, int] | None:
    """(bytes allocated and live, bytes in free heap chunks, resident or not) over every
    arena, mapped blocks counted as live; None where glibc's ``mallinfo2`` is missing."""
    info = _mallinfo2()
    if info is None:
        return None
    stats = info()
    return int(stats.uordblks + stats.hblkhd), int(stats.fordblks)


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; True if any memory was released.

    Live allocations are untouched; a page released here costs a page fault (and the
    kernel's zeroing) when the heap next uses it."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


# How far the resident memory that no live allocation accounts for may grow past the
# first step's before a step releases.
MIN_GROWTH_BYTES = 64 << 20
# Steps whose largest slack is the reference; each of them releases.
REFERENCE_STEPS = 2


def resident_bytes() -> int | None:
    """This process's resident memory (VmRSS), or None where /proc is missing."""
    kib = process_status_kib("VmRSS")
    return None if kib is None else kib * 1024


class StepHeapRelease:
    """Whether the free heap pages are given back after an optimizer step.

    Releasing costs a page fault and the kernel's zeroing for each released page that the
    next step touches again: at 19M parameters on 2 ranks, releasing after every step
    took 18-47 thousand page faults and 10-27 ms of ``malloc_trim`` per step; where the
    steps kept their pages, 0.2-5 thousand. A step that reuses the blocks the last one
    freed leaves the resident memory that no live allocation accounts for level:

        slack = resident bytes - bytes malloc holds live (heap and mapped blocks)

    that is the process's code and data outside malloc, and the free heap pages still
    resident. The first REFERENCE_STEPS steps release, and the largest slack after them
    is the reference (where the heap fragments, the first step is where it grows most: at
    101M on 4 ranks, 863 MiB). A later step releases when the heap has at least
    MIN_GROWTH_BYTES free and either

    - its free bytes grew by more than MIN_GROWTH_BYTES over the most after any earlier
      step: new heap was made around freed blocks that are not being reused (at 101M on
      4 ranks, by 280-540 MiB a step, docs/stage3-memory.md), or
    - slack exceeds the reference by more than MIN_GROWTH_BYTES: released pages were
      made resident again and not freed, which the free bytes do not show (they count
      released pages too).

    Live memory (optimizer states, a caller's caches) moves resident and live bytes alike,
    so it counts in neither. Where resident or heap bytes cannot be read, every step
    releases.
    """

    def __init__(self) -> None:
        self.reference = 0  # bytes; set by the first REFERENCE_STEPS steps
        self.steps = 0  # steps seen, up to REFERENCE_STEPS
        self.most_free = 0  # the most free heap bytes after any step so far
        self.releases = 0

    def after_step(self) -> bool:
        """Release if the slack has grown (see the class); True if it did."""
        resident, heap = resident_bytes(), heap_bytes()
        if resident is not None and heap is not None:
            live, free = heap
            slack = resident - live
            heap_grew = free > self.most_free + MIN_GROWTH_BYTES
            self.most_free = max(free, self.most_free)
            if self.steps < REFERENCE_STEPS:
                self.steps += 1
                self.reference = max(slack, self.reference)  # and release
            else:
                slack_grew = slack > self.reference + MIN_GROWTH_BYTES
                if free < MIN_GROWTH_BYTES or not (heap_grew or slack_grew):
                    return False
        self.releases += 1
        return release_free_heap()
