"""Keeping the build's temporary whole values out of the C heap, so that its peak is the
model states plus one whole value, in address space as in resident memory.

Why. The build streams the initial values one whole parameter at a time (initial_state),
each a large block that lives for one parameter. glibc serves a block below its mmap
threshold from the heap, and raises that threshold (up to 32 MiB) each time it unmaps a
larger block, so after the first freed parameter most values come from the heap. A
freed value leaves a hole, and the small blocks that outlive it (a parameter's
placeholder, a tensor's header, a dict grown by one key) are carved out of that hole
first, so the next value of the same size no longer fits there and the heap grows:

    heap   | value 1 freed, 64 B kept in it | value 2 freed, 64 B kept | value 3 ... <- top

For GPT-2 medium (355M parameters) at stage 3 on 2 ranks with every state on disk, the
heap held about 2 GiB of free blocks at the end of the build, with 112 MiB live: the
build's peak was 2.3 GiB of resident memory and 2.7 GiB of address space above its
start, against zero-estimate's 0.85 GiB on the device. The engine's ``malloc_trim`` at
the end of the build returned the pages, not the address space, which is what
``ulimit -v`` (RLIMIT_AS) caps; and the resident peak had come before it.

So while an engine is built, blocks of BUILD_MMAP_THRESHOLD bytes and up are mapped
(``mallopt(M_MMAP_THRESHOLD)``): each freed value is unmapped at once, and the heap keeps
only small blocks. Afterwards:

- under an address-space limit (RLIMIT_AS) the threshold stays there: a step's freed
  blocks then return their address space too (as ``MALLOC_MMAP_THRESHOLD_=1048576`` does;
  tools/offload/bench.py runs every probe so);
- otherwise it is set to DYNAMIC_CEILING and the trim threshold to twice that: where
  glibc's dynamic threshold ends once a step has freed a block of 32 MiB (a block of up to
  32 MiB raises it to its size), so steps allocate as they did.

A threshold set by the user (``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.
mmap_threshold`` in ``GLIBC_TUNABLES``) is left as it is, build included. Where the C
library is not glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .host_heap import _malloc_trim

BUILD_MMAP_THRESHOLD = 1 << 20  # bytes: a bucket slice or a layer's weight is mapped
DYNAMIC_CEILING = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)

_lock = threading.Lock()
_builds = 0  # engines being built now (simulated ranks build theirs in threads)


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    if _malloc_trim() is None:
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def user_chose_threshold() -> bool:
    """Whether the environment sets glibc's mmap threshold (then it is the user's)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "malloc.mmap_threshold" in tunables


def address_space_limited() -> bool:
    """Whether this process runs under an address-space limit (``ulimit -v``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return soft != resource.RLIM_INFINITY


@contextmanager
def large_blocks_mapped(enabled: bool = True) -> Iterator[None]:
    """A block (an engine's build) in which blocks of BUILD_MMAP_THRESHOLD bytes and up
    are mapped, then the threshold of the module docstring. Nothing happens unless
    ``enabled``, with a threshold the user set, or without glibc."""
    global _builds
    mallopt = _mallopt()
    if not enabled or mallopt is None or user_chose_threshold():
        yield
        return
    with _lock:
        _builds += 1
        mallopt(_M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _builds -= 1
            if _builds == 0 and not address_space_limited():
                mallopt(_M_MMAP_THRESHOLD, DYNAMIC_CEILING)
                mallopt(_M_TRIM_THRESHOLD, 2 * DYNAMIC_CEILING)
