"""A preallocated scratch file for swapping tensors to disk, in checksummed blocks.

ZeRO-Infinity keeps optimizer states (and optionally parameters) on NVMe and streams them
through a few pinned CPU buffers. This module is the disk end of that stream and knows
nothing about ZeRO: a :class:`SwapFile` is one file of ``nbytes`` reserved up front with
``posix_fallocate`` (so running out of disk shows at start, not at step 10,000), written and
read at caller-chosen offsets. Each write is a named *block*; its CRC-32, offset and length
are kept in memory and checked on every read, so a torn or edited file raises
:class:`CorruptSwapError` instead of handing the optimizer garbage.

O_DIRECT, where the filesystem allows it, keeps the page cache out of the way: the bytes go
from the caller's buffer to the device. It needs offsets, buffer addresses and transfer
sizes aligned, here to ``ALIGNMENT`` (4096, the page size and the largest logical block of
common NVMe drives). A block of ``L`` bytes at offset ``o`` occupies ``padded_bytes(L)``
bytes of the file::

    file:    | block "a" (L=6000)          | block "b" (L=4096) | ...
    offset:  0                  6000     8192               12288
                                 ^ padding, zeros: never checksummed

An aligned tensor goes to disk in one ``pwritev``/``preadv`` of two pieces: its whole pages
straight from its memory, and its last partial page through a one-page staging buffer (so
a read never writes past the tensor's own bytes, even when other tensors share its storage).
A tensor that is not aligned is copied through a per-thread aligned staging buffer in
``STAGING_BYTES`` chunks. Without O_DIRECT (tmpfs on older kernels, or ``direct=False``)
plain ``pwrite``/``pread`` are used. Both release the GIL, as does ``zlib.crc32`` on large
buffers, so a thread pool moves disjoint blocks concurrently.

Where the buffers' memory comes from matters as much: the block layer cuts an O_DIRECT
request into one segment per physically contiguous run of the buffer, and a device takes a
bounded number per request (254 on a virtio disk), so a buffer of scattered 4 KiB pages
limits requests to about 1 MiB. :func:`aligned_empty` therefore backs buffers of 2 MiB and
more with transparent huge pages; on the development VM that took 16 MiB blocks from about
1.0 to 2.0-2.5 GB/s, read and write (``tools/offload/swap.py --page-buffers`` shows the
difference). Pinned buffers allocated elsewhere should do the same (register huge-page
memory rather than allocate page by page).

Swap files are scratch: nothing here survives the process, and nothing is fsynced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch

from zero_comm.profiler_ranges import profiler_range

log = logging.getLogger(__name__)

ALIGNMENT = 4096  # bytes: offsets, buffer addresses and I/O sizes for O_DIRECT
STAGING_BYTES = 4 << 20  # per-thread bounce buffer for tensors that are not aligned
# One bounce buffer per thread for every swap file: a thread moves one block at a time,
# and an engine has hundreds of files (a buffer per file and thread held 200 MiB).
_THREAD_STAGING = threading.local()
HUGE_PAGE = 2 << 20  # aligned_empty backs buffers this large with transparent huge pages
GIB = 2**30
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_SCRATCH_ADVICE = (
    "the swap file is torn or was changed behind the engine's back; swap files are "
    "scratch: resume from the last checkpoint"
)


class SwapError(RuntimeError):
    """A swap file could not be written or read."""


class CorruptSwapError(SwapError):
    """A block read back is not what was written: checksum mismatch, short read, or never
    written."""


class SwapSpaceError(SwapError):
    """The offload folder has no room for the swap files."""


def padded_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGNMENT``."""
    if nbytes < 0:
        raise ValueError(f"padded_bytes: nbytes must be >= 0, got {nbytes}")
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _thread_buffer(name: str, nbytes: int) -> torch.Tensor:
    """The calling thread's aligned buffer ``name`` of ``nbytes`` bytes (made once)."""
    buffer: torch.Tensor | None = getattr(_THREAD_STAGING, name, None)
    if buffer is None:
        buffer = aligned_empty(nbytes, torch.uint8)
        setattr(_THREAD_STAGING, name, buffer)
    return buffer


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements at an ``ALIGNMENT``-aligned address whose
    storage extends at least ``padded_bytes(numel * itemsize)`` bytes from its start.

    From ``HUGE_PAGE`` bytes up it is an anonymous mapping aligned to ``HUGE_PAGE`` and
    advised ``MADV_HUGEPAGE``: an O_DIRECT request is cut into one segment per physically
    contiguous run of the buffer (a virtio disk takes at most 254 per request), so 4 KiB
    pages cap a request at about 1 MiB and halve or quarter the bandwidth; 2 MiB pages do
    not (tools/offload/swap.py, ``--page-buffers``).
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    itemsize = dtype.itemsize
    padded = padded_bytes(numel * itemsize)
    if padded == 0:
        return torch.empty(0, dtype=dtype, device="cpu")
    if padded >= HUGE_PAGE:
        raw = _huge_page_bytes(padded)
    else:
        # Over-allocate by one page and start at the first aligned byte. The CPU allocator
        # aligns to 64 bytes, so the shift is a multiple of every itemsize.
        raw = torch.empty(padded + ALIGNMENT, dtype=torch.uint8, device="cpu")
        shift = -raw.data_ptr() % ALIGNMENT
        raw = raw[shift : shift + padded]  # (padded,) bytes at an aligned address
    return raw.view(dtype)[:numel]  # (numel,)


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory starting on a ``HUGE_PAGE`` boundary, advised
    to use transparent huge pages (where the kernel has them: a hint, never an error)."""
    mapping = mmap.mmap(
        -1, nbytes + HUGE_PAGE - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    advice: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # EINVAL where THP is compiled out
            mapping.madvise(advice)
    # The tensor holds the only reference to the mapping, which unmaps when the last view
    # of the storage goes (nothing else can close it).
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    shift = -whole.data_ptr() % HUGE_PAGE
    return whole[shift : shift + nbytes]


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _space_message(folder: Path, needed: int, available: int | None, what: str = "") -> str:
    have = "unknown" if available is None else f"{available} bytes ({_gib(available)})"
    what = what or "the swap files need"
    return (
        f"offload folder {folder} has no room: {what} {needed} bytes ({_gib(needed)}), the "
        f"filesystem has {have} free for this user. Free space there, point the offload "
        "folder at a larger disk, or offload less (e.g. keep parameters in CPU memory and "
        "swap only optimizer states)"
    )


def _free_bytes_or_none(folder: Path) -> int | None:
    try:
        return _free_bytes(folder)
    except OSError:
        return None


def check_offload_dir(path: str | os.PathLike[str], bytes_needed: int) -> Path:
    """Refuse, before training starts, an offload folder the swap files cannot live in.

    Raises ``ValueError`` (the folder is missing, not a folder, or not writable, with the
    fix) or :class:`SwapSpaceError` (less than ``bytes_needed`` free). Returns the resolved
    folder.
    """
    if bytes_needed < 0:
        raise ValueError(f"check_offload_dir: bytes_needed must be >= 0, got {bytes_needed}")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ValueError(
            f"offload folder {folder} does not exist: create it (mkdir -p {folder}) on a "
            "local NVMe drive, or point the offload folder at one that exists"
        )
    if not folder.is_dir():
        raise ValueError(
            f"offload folder {folder} is not a folder: point the offload folder at a "
            "directory (swap files are created inside it)"
        )
    folder = folder.resolve()
    read_only = f"offload folder {folder} is on a read-only filesystem: remount it "
    read_only += "read-write or point the offload folder at a writable disk"
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        raise ValueError(read_only)
    probe = folder / f".zero-swap-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.EROFS:
            raise ValueError(read_only) from e
        if e.errno in _NO_SPACE:
            raise SwapSpaceError(_space_message(folder, bytes_needed, _free_bytes(folder))) from e
        raise ValueError(
            f"offload folder {folder} is not writable by this process (creating a probe file "
            f"failed: {os.strerror(e.errno or 0)}): fix its permissions (chown/chmod) or point "
            "the offload folder at a writable disk"
        ) from e
    available = _free_bytes(folder)
    if available < bytes_needed:
        raise SwapSpaceError(_space_message(folder, bytes_needed, available))
    return folder


class _Record(NamedTuple):
    """What a write left behind, checked by the read of the same block."""

    offset: int
    nbytes: int
    crc32: int


def _byte_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The tensor's own bytes as a flat uint8 tensor sharing its memory."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what}: the tensor is on {tensor.device}; swap files move CPU memory: copy it "
            "into a (pinned) CPU buffer first"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what}: the tensor (shape {tuple(tensor.shape)}, stride {tensor.stride()}) is "
            "not contiguous: pass a contiguous buffer"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


def _memview(raw: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a flat uint8 CPU tensor's memory (an empty one if
    empty). It does not keep the tensor alive: use it only while ``raw`` is referenced."""
    n = raw.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(raw.data_ptr())).cast("B")


class SwapFile:
    """One preallocated scratch file, read and written in checksummed blocks at given offsets.

    ``write(offset, tensor, block)`` stores the tensor's bytes at ``offset`` (a multiple of
    ``ALIGNMENT``) and records their CRC-32 under ``block``; ``read(offset, tensor, block)``
    fills ``tensor`` from the same place and raises :class:`CorruptSwapError` unless the bytes
    match. Different blocks may be written and read concurrently from several threads; one
    block must not be written and read at the same time.
    """

    def __init__(self, path: str | os.PathLike[str], nbytes: int, *, direct: bool = True) -> None:
        if nbytes < 0:
            raise ValueError(f"SwapFile({path}): nbytes must be >= 0, got {nbytes}")
        self.path = Path(path)
        self.nbytes = nbytes
        self.direct = False
        self._reserved = padded_bytes(nbytes)
        self._records: dict[str, _Record] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._folder = folder = self.path.parent.absolute()
        try:
            self._buffered_fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            if e.errno in _NO_SPACE:
                available = _free_bytes_or_none(folder)
                raise SwapSpaceError(_space_message(folder, self._reserved, available)) from e
            raise SwapError(
                f"cannot create swap file {self.path}: {os.strerror(e.errno or 0)}"
            ) from e
        try:
            if self._reserved:
                os.posix_fallocate(self._buffered_fd, 0, self._reserved)
        except OSError as e:
            os.close(self._buffered_fd)
            self.path.unlink(missing_ok=True)
            if e.errno in _NO_SPACE:
                available = _free_bytes(folder)
                raise SwapSpaceError(_space_message(folder, self._reserved, available)) from e
            raise SwapError(
                f"cannot reserve {self._reserved} bytes for swap file {self.path}: "
                f"{os.strerror(e.errno or 0)}"
            ) from e
        self._fd = self._buffered_fd
        o_direct: int = getattr(os, "O_DIRECT", 0)  # Linux; absent on macOS
        if direct and o_direct:
            try:
                self._fd = os.open(self.path, os.O_RDWR | o_direct)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    self.close()
                    self.path.unlink(missing_ok=True)
                    raise SwapError(
                        f"cannot open swap file {self.path} for direct I/O: "
                        f"{os.strerror(e.errno or 0)}"
                    ) from e
                log.info("%s: the filesystem refuses O_DIRECT; using buffered I/O", self.path)

    def __repr__(self) -> str:
        return f"SwapFile({str(self.path)!r}, nbytes={self.nbytes}, direct={self.direct})"

    # -- writing and reading -----------------------------------------------------------

    def write(self, offset: int, tensor: torch.Tensor, block: str) -> None:
        """Write ``tensor``'s bytes at ``offset`` and record their CRC-32 as ``block``."""
        with profiler_range("swap.write"):  # the checksum too: both take time
            self._write(offset, tensor, block)

    def _write(self, offset: int, tensor: torch.Tensor, block: str) -> None:
        raw = _byte_view(tensor, f"{self!r}.write(block {block!r})")
        self._check_range(offset, raw.numel(), block, "write")
        data = _memview(raw)
        crc = zlib.crc32(data)
        with self._lock:
            self._records.pop(block, None)
            self._failed.pop(block, None)
        try:
            self._transfer(offset, raw, data, writing=True)
        except OSError as e:
            with self._lock:
                self._failed[block] = os.strerror(e.errno or 0)
            if e.errno in _NO_SPACE:
                what = (
                    f"writing block {block!r} at offset {offset} of {self.path} ran out of "
                    f"space although SwapFile reserved {self._reserved} bytes at creation (the "
                    "filesystem is copy-on-write, thin-provisioned or under a quota, or the "
                    "file was replaced); the block needs"
                )
                folder = self._folder
                available = _free_bytes_or_none(folder)
                raise SwapSpaceError(
                    _space_message(folder, padded_bytes(len(data)), available, what)
                ) from e
            raise SwapError(
                f"writing block {block!r} ({len(data)} bytes) at offset {offset} of "
                f"{self.path} failed: {os.strerror(e.errno or 0)} (errno {e.errno})"
            ) from e
        with self._lock:
            self._records[block] = _Record(offset, len(data), crc)

    def read(self, offset: int, tensor: torch.Tensor, block: str) -> None:
        """Fill ``tensor`` from ``offset`` and check the bytes against ``block``'s CRC-32."""
        with profiler_range("swap.read"):
            self._read(offset, tensor, block)

    def _read(self, offset: int, tensor: torch.Tensor, block: str) -> None:
        raw = _byte_view(tensor, f"{self!r}.read(block {block!r})")
        self._check_range(offset, raw.numel(), block, "read")
        with self._lock:
            record = self._records.get(block)
            failed = self._failed.get(block)
        if record is None:
            why = f"its last write failed ({failed})" if failed else "it was never written"
            raise CorruptSwapError(
                f"{self.path}: cannot read block {block!r} at offset {offset}: block "
                f"{block!r} has no checksum because {why}; write a block before reading it"
            )
        if (record.offset, record.nbytes) != (offset, raw.numel()):
            raise ValueError(
                f"{self.path}: block {block!r} was written at offset {record.offset} with "
                f"{record.nbytes} bytes, but the read asks for offset {offset} with "
                f"{raw.numel()} bytes: read a block into a buffer of the size it was written "
                "from, at the same offset"
            )
        data = _memview(raw)
        try:
            got = self._transfer(offset, raw, data, writing=False)
        except OSError as e:
            raise SwapError(
                f"reading block {block!r} ({len(data)} bytes) at offset {offset} of "
                f"{self.path} failed: {os.strerror(e.errno or 0)} (errno {e.errno})"
            ) from e
        if got < len(data):
            raise CorruptSwapError(
                f"{self.path}: short read of block {block!r} at offset {offset}: got {got} of "
                f"{len(data)} bytes (expected crc32 {record.crc32:#010x}, the file ends "
                f"early); {_SCRATCH_ADVICE}"
            )
        actual = zlib.crc32(data)
        if actual != record.crc32:
            raise CorruptSwapError(
                f"{self.path}: block {block!r} at offset {offset} ({len(data)} bytes) has "
                f"crc32 {actual:#010x}, expected {record.crc32:#010x}: {_SCRATCH_ADVICE}"
            )

    def _check_range(self, offset: int, length: int, block: str, op: str) -> None:
        if offset < 0 or offset % ALIGNMENT:
            raise ValueError(
                f"{self.path}: {op} of block {block!r} at offset {offset}: offsets must be "
                f"non-negative multiples of ALIGNMENT ({ALIGNMENT}); place blocks at "
                "multiples of padded_bytes(...)"
            )
        end = offset + padded_bytes(length)
        if end > self._reserved:
            raise ValueError(
                f"{self.path}: {op} of block {block!r} ({length} bytes, {padded_bytes(length)} "
                f"padded) at offset {offset} ends at {end}, past the {self._reserved} bytes "
                f"reserved (SwapFile nbytes={self.nbytes}): size the file as the sum of "
                "padded_bytes(...) of its blocks"
            )
        if self._closed:
            raise SwapError(f"{self.path}: {op} of block {block!r} after close()")

    def _transfer(self, offset: int, raw: torch.Tensor, data: memoryview, writing: bool) -> int:
        """Move ``data`` to or from ``offset``; returns the bytes moved (short only at EOF)."""
        n = len(data)
        if n == 0:
            return 0
        if not self.direct:
            return _loop(self._buffered_fd, [data], offset, writing)
        if raw.data_ptr() % ALIGNMENT:
            return self._transfer_staged(offset, raw, n, writing)
        body = n - n % ALIGNMENT
        pieces = [data[:body]] if body else []
        page: torch.Tensor | None = None
        if body < n:
            tail = n - body
            page = self._tail_page()
            if writing:
                page[:tail].copy_(raw[body:])
                page[tail:].zero_()
            pieces.append(_memview(page))
        moved = self._loop_direct(pieces, offset, writing)
        if page is not None and not writing:
            tail = max(0, min(n, moved) - body)
            raw[body : body + tail].copy_(page[:tail])
        return min(n, moved)

    def _transfer_staged(self, offset: int, raw: torch.Tensor, n: int, writing: bool) -> int:
        """Move an unaligned tensor's bytes through this thread's aligned staging buffer."""
        staging = self._staging()
        done = 0
        while done < n:
            chunk = min(STAGING_BYTES, n - done)
            span = padded_bytes(chunk)
            if writing:
                staging[:chunk].copy_(raw[done : done + chunk])
                staging[chunk:span].zero_()
            moved = self._loop_direct([_memview(staging[:span])], offset + done, writing)
            got = min(chunk, moved)
            if not writing:
                raw[done : done + got].copy_(staging[:got])
            done += got
            if got < chunk:
                break
        return done

    def _loop_direct(self, pieces: list[memoryview], offset: int, writing: bool) -> int:
        """Direct I/O over ``pieces``; a transfer cut short at an unaligned point is finished
        with buffered I/O (O_DIRECT would refuse the unaligned remainder)."""
        total = sum(len(p) for p in pieces)
        moved = _loop(self._fd, pieces, offset, writing, stop_unaligned=True)
        if moved < total and moved % ALIGNMENT:
            moved += _loop(self._buffered_fd, _advance(pieces, moved), offset + moved, writing)
        return moved

    def _tail_page(self) -> torch.Tensor:
        """This thread's one aligned page for the last, partial page of a transfer."""
        return _thread_buffer("page", ALIGNMENT)

    def _staging(self) -> torch.Tensor:
        """This thread's bounce buffer for tensors that are not aligned."""
        return _thread_buffer("staging", STAGING_BYTES)

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (idempotent); its blocks can no longer be read."""
        if self._closed:
            return
        self._closed = True
        if self._fd != self._buffered_fd:
            os.close(self._fd)
        os.close(self._buffered_fd)

    def remove(self) -> None:
        """Close and delete the file (idempotent)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def _advance(pieces: list[memoryview], nbytes: int) -> list[memoryview]:
    """``pieces`` without their first ``nbytes`` bytes."""
    out: list[memoryview] = []
    for piece in pieces:
        if nbytes >= len(piece):
            nbytes -= len(piece)
            continue
        out.append(piece[nbytes:])
        nbytes = 0
    return out


def _loop(
    fd: int,
    pieces: list[memoryview],
    offset: int,
    writing: bool,
    stop_unaligned: bool = False,
) -> int:
    """``pwritev``/``preadv`` until ``pieces`` are done, the file ends, or (with
    ``stop_unaligned``) a short transfer leaves an unaligned position. Returns bytes moved."""
    call: Callable[[int, list[memoryview], int], int] = os.pwritev if writing else os.preadv
    total = sum(len(p) for p in pieces)
    done = 0
    while done < total:
        rest = _advance(pieces, done)
        n = call(fd, rest, offset + done)
        if n <= 0:
            if writing:
                raise OSError(errno.EIO, f"pwritev wrote {n} bytes")
            break
        done += n
        if stop_unaligned and done < total and done % ALIGNMENT:
            break
    return done
