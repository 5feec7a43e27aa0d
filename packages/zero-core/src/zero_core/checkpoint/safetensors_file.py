"""Safetensors files, written as a stream and read by byte range, with block checksums.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length,
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}``, then the tensors' bytes. Any safetensors reader loads our files; we add, outside
the file, a CRC-32 of every ``block_bytes`` of the data section, so a reader of a byte
range checks just the blocks it touches:

    | len | header JSON (space-padded to 8) | data: block 0 | block 1 | ... | last |
                                            ^ data_start     crc[0]   crc[1]

Nothing here knows about ZeRO.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPE_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
NAME_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
BLOCK_BYTES = 1 << 20


class CorruptFileError(ValueError):
    """A file's bytes are not what its index says: truncated, changed or not ours."""


@dataclass(frozen=True)
class WrittenFile:
    """What a reader needs to trust a file: its size, each data block's CRC-32, and the
    CRC-32 of its header (length and JSON: every tensor's name, dtype, shape and offsets),
    which files written before it was recorded lack (None: the header is read unchecked)."""

    bytes: int
    block_bytes: int
    crc32: list[int]
    header_crc32: int | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bytes": self.bytes, "block_bytes": self.block_bytes, "crc32": self.crc32
        }  # fmt: skip
        if self.header_crc32 is not None:
            out["header_crc32"] = self.header_crc32
        return out

    @classmethod
    def from_json(cls, value: dict[str, object]) -> WrittenFile:
        crcs: Any = value["crc32"]
        size: Any = value["bytes"]
        block: Any = value["block_bytes"]
        header: Any = value.get("header_crc32")
        return cls(int(size), int(block), [int(c) for c in crcs],
                   None if header is None else int(header))  # fmt: skip


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array)


def write_file(
    path: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> WrittenFile:
    """Write ``tensors`` to ``path`` (see :func:`write_stream`)."""
    items = list(tensors)
    specs = [(name, t.dtype, list(t.shape)) for name, t in items]
    return write_stream(path, specs, (t for _, t in items), metadata, block_bytes)


# One tensor's value: the tensor, or its elements in order as 1-D chunks (a tensor that
# lives in pieces, such as a shard's tiles, written without first joining them).
Value = torch.Tensor | Sequence[torch.Tensor]


def write_stream(
    path: Path,
    specs: list[tuple[str, torch.dtype, list[int]]],
    values: Iterable[Value],
    metadata: dict[str, str] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> WrittenFile:
    """Write tensors described by ``specs`` (name, dtype, shape), their values coming one
    at a time from ``values`` (memory: one tensor, or one chunk of a chunked one), through
    a temporary name, fsync, rename. A chunked value's chunks must hold the spec's dtype
    and, together, its element count; the file is the same as for the joined tensor.
    Returns the size and block checksums."""
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(path.name + ".partial")
    try:
        return _write_partial(partial, path, text, specs, values, block_bytes, offset)
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed write leaves nothing behind
        raise


class _BlockCrcs:
    """CRC-32 of every ``block_bytes`` of a byte stream fed in pieces of any length."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.crcs: list[int] = []
        self.carry = bytearray()  # the start of a block that the next piece completes

    def feed(self, data: memoryview) -> None:
        block = self.block_bytes
        if self.carry:
            need = block - len(self.carry)
            self.carry += data[:need]
            data = data[need:]
            if len(self.carry) == block:
                self.crcs.append(zlib.crc32(self.carry))
                self.carry = bytearray()
        whole = len(data) // block * block
        self.crcs += [zlib.crc32(data[at : at + block]) for at in range(0, whole, block)]
        self.carry += data[whole:]

    def finish(self) -> list[int]:
        if self.carry:
            self.crcs.append(zlib.crc32(self.carry))
            self.carry = bytearray()
        return self.crcs


def _chunks(
    name: str, dtype: torch.dtype, shape: list[int], value: Value
) -> Iterator[torch.Tensor]:
    """The value's pieces, checked against its spec as they come."""
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype or list(value.shape) != list(shape):
            raise ValueError(f"{name}: got {value.dtype} {tuple(value.shape)}, "
                             f"declared {dtype} {tuple(shape)}")  # fmt: skip
        yield value
        return
    seen = 0
    for chunk in value:
        if chunk.dtype != dtype:
            raise ValueError(f"{name}: a chunk is {chunk.dtype}, declared {dtype}")
        seen += chunk.numel()
        yield chunk
    if seen != math.prod(shape):
        raise ValueError(f"{name}: chunks hold {seen} elements, declared {tuple(shape)}")


def _write_partial(
    partial: Path,
    path: Path,
    text: bytes,
    specs: list[tuple[str, torch.dtype, list[int]]],
    values: Iterable[Value],
    block_bytes: int,
    offset: int,
) -> WrittenFile:
    crcs = _BlockCrcs(block_bytes)
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for (name, dtype, shape), value in zip(specs, values, strict=True):
            for chunk in _chunks(name, dtype, shape, value):
                data = _raw_bytes(chunk)
                out.write(data)
                crcs.feed(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    head = struct.pack("<Q", len(text)) + text
    return WrittenFile(8 + len(text) + offset, block_bytes, crcs.finish(), zlib.crc32(head))


class TensorFile:
    """Reads tensors, or element ranges of them, from one safetensors file; checks the
    size and the CRC of every block it reads against ``expected`` when given."""

    def __init__(self, path: Path, expected: WrittenFile | None = None) -> None:
        self.path = path
        self.expected = expected
        if not path.exists():
            raise CorruptFileError(f"{path}: missing")
        size = path.stat().st_size
        if expected is not None and size != expected.bytes:
            raise CorruptFileError(
                f"{path}: {size} bytes, but the index says {expected.bytes} (truncated or "
                "replaced after saving)"
            )
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CorruptFileError(f"{path}: header length {length} exceeds the file")
            text = f.read(length)
            recorded = expected.header_crc32 if expected is not None else None
            if recorded is not None and zlib.crc32(head + text) != recorded:
                raise CorruptFileError(
                    f"{path}: its header (the names, dtypes, shapes and offsets of its "
                    "tensors) does not match its checksum in the index: changed after saving"
                )
            try:
                self.header = json.loads(text)
            except ValueError as exc:
                raise CorruptFileError(f"{path}: unreadable header ({exc})") from exc
        self.data_start = 8 + length
        self.size = size
        if not isinstance(self.header, dict):
            raise CorruptFileError(f"{path}: its header is not a JSON object")
        self.metadata: dict[str, str] = self.header.pop("__metadata__", {}) or {}
        if expected is not None:
            blocks = -(-(size - self.data_start) // expected.block_bytes)
            if expected.block_bytes < 1 or len(expected.crc32) != blocks:
                raise CorruptFileError(
                    f"{path}: the index holds {len(expected.crc32)} block checksums for its "
                    f"{blocks} blocks of data (the index is damaged)"
                )

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def entry(self, name: str) -> tuple[torch.dtype, list[int], int, int]:
        """(dtype, shape, first byte, end byte in the data section) of tensor ``name``,
        checked against itself and the file before anything is allocated for it: a
        header claiming 4 TB in a small file is named, not a MemoryError."""
        if name not in self.header:
            raise CorruptFileError(f"{self.path}: has no tensor {name!r}")
        info = self.header[name]
        try:
            dtype = NAME_DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(
                f"{self.path}: the header entry of {name!r} is malformed: {info!r}"
            ) from None
        data = self.size - self.data_start
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data or (
            end - begin != math.prod(shape) * dtype.itemsize
        ):  # fmt: skip
            raise CorruptFileError(
                f"{self.path}: {name!r} claims {tuple(shape)} {dtype} at bytes {begin}..{end} "
                f"of a data section of {data} bytes, which do not hold it"
            )
        return dtype, shape, begin, end

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of tensor ``name``, flat (the whole tensor, shaped,
        when no range is given)."""
        dtype, shape, begin, end = self.entry(name)
        itemsize = dtype.itemsize
        count = (end - begin) // itemsize
        whole = stop is None and start == 0
        stop = count if stop is None else stop
        if not 0 <= start <= stop <= count:
            raise CorruptFileError(f"{self.path}: {name}[{start}:{stop}] is outside 0..{count}")
        raw = self._read_bytes(begin + start * itemsize, begin + stop * itemsize)
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(shape) if whole else flat

    def _read_bytes(self, first: int, last: int) -> bytearray:
        """Data-section bytes [first, last), verified block by block."""
        if first == last:
            return bytearray()
        expected = self.expected
        lo, hi = first, last
        if expected is not None:
            lo = first // expected.block_bytes * expected.block_bytes
            hi = min(-(-last // expected.block_bytes) * expected.block_bytes,
                     expected.bytes - self.data_start)  # fmt: skip
        with self.path.open("rb") as f:
            f.seek(self.data_start + lo)
            span = bytearray(f.read(hi - lo))
        if len(span) != hi - lo:
            raise CorruptFileError(f"{self.path}: ends inside its data (truncated)")
        if expected is not None:
            size = expected.block_bytes
            for k, at in enumerate(range(0, len(span), size)):
                block = (lo // size) + k
                if zlib.crc32(span[at : at + size]) != expected.crc32[block]:
                    raise CorruptFileError(
                        f"{self.path}: block {block} (bytes {lo + at}..{lo + at + size} of "
                        "the data) fails its checksum: the file was changed after saving"
                    )
        return span[first - lo : last - lo]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time, in file order (memory: the largest tensor)."""
        for name in sorted(self.header, key=lambda n: self.entry(n)[2]):
            yield name, self.read(name)


def read_state_dict(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, one tensor in memory at a time: for
    ``zero_core.initialize(..., init_values=read_state_dict("model.safetensors"))``."""
    yield from TensorFile(Path(path)).tensors()
