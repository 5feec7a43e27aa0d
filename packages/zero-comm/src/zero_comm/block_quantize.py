"""Symmetric block quantization to int8 or int4, and its wire format (ZeRO++'s codec).

A flat tensor is cut into blocks of ``block_numel`` elements (the last one may be short).
Each block gets one float32 scale, and each element an integer code:

    scale = absmax(block) / qmax                qmax = 127 (int8), 7 (int4)
    code  = clamp(round(x / scale), -qmax, qmax)     round half to even (torch.round)
    x~    = code * scale                             (decoded; 0 where scale == 0)

Scale and quotient are computed in float32 whatever the input's dtype (float32, bfloat16,
float16), elementwise and with no reduction across blocks, so encoding is deterministic:
the same input gives the same bytes on every run, device kind and backend.

Error bound. ``|x - x~| <= scale / 2`` in exact arithmetic; computed in float32 it is

    |x - x~| <= scale / 2 + (2 qmax + 1) * 2^-24 * scale      (float32 output)

(the quotient is rounded once before ``round``, and ``code * scale`` once after), plus half
an ulp of the output dtype where the decoded values are cast to bfloat16 or float16. The
bound is relative to the block's scale only while it is a normal float32, that is for
blocks with absmax above ``qmax * 2^-126`` (about 1.5e-36); below, the scale loses bits.
A block holding a NaN or an infinity has a non-finite scale (a NaN is always sent as the
quiet NaN 0x7fc00000) and decodes to non-finite values throughout, so an overflow is never
hidden by the codec (a loss scaler still sees it). An all-zero block has scale 0 and
decodes to zeros.

Wire format. One encoded *part* of ``n`` elements is one contiguous uint8 buffer, the
payload then the scales, so that a single collective moves both::

    n = 10, block_numel = 4, int8:  3 blocks (4 + 4 + 2 elements), 10 + 3*4 = 22 bytes

    byte 0         4         8   10                                   22
         | c0..c3  | c4..c7  |c8 c9| scale 0  | scale 1  | scale 2  |
         '------- payload: one int8 code per byte ------'-- 3 x float32 --'

    int4: two codes per byte, element 2i in the low nibble and 2i+1 in the high one,
          each stored as code + 8 (1..15); an odd n leaves one padding nibble (code 0, stored 8):

         byte k = (code[2k+1] + 8) << 4 | (code[2k] + 8)       payload = ceil(n/2) bytes

Scales are float32 in the machine's byte order (the ranks of one job share it). Several
parts of equal ``n`` lie end to end, part i at byte ``i * encoded_numel(n)``: that is how
the collectives of quantized.py send one part per destination rank in one buffer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QMAX = {8: 127, 4: 7}
SCALE_BYTES = 4  # one float32 per block


class Quantized(NamedTuple):
    """The codes and scales of ``numel`` elements (one part, see the module docstring)."""

    payload: torch.Tensor  # uint8, BlockQuantizer.payload_bytes(numel)
    scales: torch.Tensor  # float32, BlockQuantizer.num_blocks(numel)
    numel: int


@dataclass(frozen=True)
class BlockQuantizer:
    """Symmetric per-block quantization to ``bits`` (8 or 4) bits; see the module docstring.

    ``block_numel`` is the number of elements sharing one scale (ZeRO++ uses groups of a few
    thousand); int4 needs it even, so that every block starts on a byte.
    """

    bits: int
    block_numel: int

    def __post_init__(self) -> None:
        if self.bits not in QMAX:
            raise ValueError(f"BlockQuantizer: bits={self.bits!r}; use 8 (int8) or 4 (int4)")
        if not isinstance(self.block_numel, int) or self.block_numel < 1:
            raise ValueError(
                f"BlockQuantizer: block_numel={self.block_numel!r}; use an int >= 1 "
                "(a few thousand is usual: 4 bytes of scale per block)"
            )
        if self.bits == 4 and self.block_numel % 2:
            raise ValueError(
                f"BlockQuantizer: int4 packs two codes per byte, so block_numel must be even "
                f"for every block to start on a byte; got {self.block_numel}, use "
                f"{self.block_numel + 1}"
            )

    @property
    def qmax(self) -> int:
        """The largest code: 127 for int8, 7 for int4."""
        return QMAX[self.bits]

    # ------------------------------------------------------------------ sizes
    def num_blocks(self, numel: int) -> int:
        """Blocks (and so scales) of a part of ``numel`` elements; the last may be short."""
        return -(-numel // self.block_numel)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of codes for ``numel`` elements: ``numel`` (int8), ``ceil(numel/2)`` (int4)."""
        return -(-numel * self.bits // 8)

    def encoded_numel(self, numel: int) -> int:
        """Bytes on the wire for a part of ``numel`` elements: payload plus scales."""
        return self.payload_bytes(numel) + SCALE_BYTES * self.num_blocks(numel)

    # ------------------------------------------------------- codes and scales
    def quantize(self, x: torch.Tensor) -> Quantized:
        """The codes and scales of ``x`` (any shape, flattened; float32, bfloat16, float16)."""
        self._check_input("quantize", x)
        n = x.numel()
        payload = torch.empty(1, self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        scales = self._encode_rows(x.reshape(1, n), payload)
        return Quantized(payload.view(-1), scales.view(-1), n)

    def dequantize(self, q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``q.numel`` decoded values, flat, in ``dtype`` (computed in float32)."""
        if q.payload.dtype != torch.uint8 or q.scales.dtype != torch.float32:
            raise TypeError(
                f"dequantize: payload must be uint8 and scales float32, got {q.payload.dtype} "
                f"and {q.scales.dtype} (pass what quantize returned)"
            )
        self._check_sizes("dequantize", q.payload.numel(), self.payload_bytes(q.numel), "payload")
        self._check_sizes("dequantize", q.scales.numel(), self.num_blocks(q.numel), "scales")
        values = torch.empty(1, q.numel, dtype=torch.float32, device=q.payload.device)
        self._decode_rows(
            q.payload.view(1, q.payload.numel()), q.scales.view(1, q.scales.numel()), values
        )
        return values.to(dtype).reshape(-1)

    # ------------------------------------------------------------- the wire
    def encode(self, x: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """``x`` as ``parts`` wire parts, end to end: uint8, ``parts * encoded_numel(n)``
        bytes, where ``x`` (flattened) is ``parts`` equal chunks of ``n`` elements and part
        i encodes chunk i (its blocks start at the chunk's start)."""
        self._check_input("encode", x)
        if parts < 1 or x.numel() % parts:
            raise ValueError(
                f"encode: {x.numel()} elements do not split into parts={parts} equal chunks; "
                "pad the input to a multiple of parts"
            )
        n = x.numel() // parts
        split = self.payload_bytes(n)
        wire = torch.empty(parts, self.encoded_numel(n), dtype=torch.uint8, device=x.device)
        scales = self._encode_rows(x.reshape(parts, n), wire[:, :split])
        wire[:, split:].copy_(scales.view(torch.uint8).view(parts, -1))
        return wire.view(-1)

    def decode(
        self,
        wire: torch.Tensor,
        numel: int,
        parts: int = 1,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The inverse of :meth:`encode`: ``parts`` parts of ``numel`` elements each, as one
        flat tensor of ``parts * numel`` values in ``dtype`` (computed in float32).

        ``out``, a contiguous tensor of ``parts * numel`` elements of a quantizable dtype,
        receives the values instead (cast to its dtype) and is returned, flattened: a
        float32 ``out`` is decoded into with no temporary."""
        if wire.dtype != torch.uint8 or wire.dim() != 1:
            raise TypeError(
                f"decode: the wire must be a flat uint8 tensor, got {wire.dtype} of shape "
                f"{tuple(wire.shape)}"
            )
        encoded = self.encoded_numel(numel)
        self._check_sizes("decode", wire.numel(), parts * encoded, f"wire of {parts} parts")
        if out is not None:
            if out.dtype not in QUANTIZABLE_DTYPES:
                raise TypeError(
                    f"decode: out must be float32, bfloat16 or float16, got {out.dtype}"
                )
            self._check_sizes("decode", out.numel(), parts * numel, "out")
            if not out.is_contiguous():
                raise ValueError("decode: out must be contiguous; pass .contiguous()")
            if (
                out.numel()
                and out.untyped_storage().data_ptr() == wire.untyped_storage().data_ptr()
            ):
                raise ValueError(
                    "decode: out shares memory with the wire, which decoding would overwrite "
                    "before reading it all; decode into another tensor"
                )
            dtype = out.dtype
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=wire.device) if out is None else out.view(-1)
        rows = wire.view(parts, encoded)
        split = self.payload_bytes(numel)
        # A copy: the scales of part i start at an arbitrary byte, too unaligned to view.
        scale_bytes = torch.empty(parts, encoded - split, dtype=torch.uint8, device=wire.device)
        scales = scale_bytes.copy_(rows[:, split:]).view(torch.float32)
        # A float32 out is decoded into; any other gets the values cast from a temporary.
        direct = out.view(parts, numel) if out is not None and out.dtype == torch.float32 else None
        values = (
            direct
            if direct is not None
            else torch.empty(parts, numel, dtype=torch.float32, device=wire.device)
        )
        self._decode_rows(rows[:, :split], scales, values)
        if out is None:
            return values.to(dtype).reshape(-1)
        if direct is None:
            out.view(parts, numel).copy_(values)
        return out.view(-1)

    # ------------------------------------------------------------ internals
    def _check_input(self, what: str, x: torch.Tensor) -> None:
        if x.dtype not in QUANTIZABLE_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in QUANTIZABLE_DTYPES)
            raise TypeError(f"{what}: cannot quantize {x.dtype}; supported: {names}")

    @staticmethod
    def _check_sizes(what: str, got: int, expected: int, name: str) -> None:
        if got != expected:
            raise ValueError(f"{what}: the {name} holds {got} bytes or values, expected {expected}")

    def _blocks(self, rows: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
        """``rows`` (parts, n), n contiguous, as views of whole blocks: (the block columns,
        a view (parts, blocks, block_numel)) for the full blocks, then (the last column, a
        view (parts, 1, n % block_numel)) for a short last block. No copy, no padding."""
        parts, n = rows.shape
        full = n // self.block_numel
        views = []
        if full:
            body = rows[:, : full * self.block_numel]
            views.append((slice(0, full), body.view(parts, full, self.block_numel)))
        if n % self.block_numel:
            views.append((slice(full, full + 1), rows[:, full * self.block_numel :].unsqueeze(1)))
        return views

    def _encode_rows(self, rows: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """Write the codes of ``rows`` (parts, n) into ``payload`` (parts, payload_bytes(n))
        uint8, a view whose last dimension is contiguous; return the scales (parts,
        num_blocks(n)) float32. The arithmetic of the module docstring, step for step."""
        parts, n = rows.shape
        # Encoding is not differentiable; detached, a parameter (requires_grad) may go in.
        values = rows.detach().to(torch.float32)  # no copy of a float32 input: only read
        if values.stride(1) != 1:
            values = values.contiguous()
        blocks = self._blocks(values)
        scales = torch.empty(parts, self.num_blocks(n), dtype=torch.float32, device=rows.device)
        for columns, block in blocks:
            # absmax as max(max, -min): two reductions, no |x| temporary; NaN propagates
            # through both and through maximum, and abs_ below makes a zero's sign +.
            torch.maximum(block.amax(dim=2), block.amin(dim=2).neg_(), out=scales[:, columns])
        # A tensor divisor: CUDA divides by a CPU scalar as a * (1 / b), which can differ
        # by an ulp from the CPU's a / b, and the scales must be the same bytes everywhere.
        scales.abs_().div_(torch.full((), float(self.qmax), device=scales.device))
        # One NaN on the wire, whichever NaN the block held or maximum() made of it.
        scales.masked_fill_(scales.isnan(), float("nan"))
        # An all-zero block: any divisor gives codes 0; 1 avoids 0/0.
        divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
        quotients = torch.empty(parts, n, dtype=torch.float32, device=rows.device)
        for (columns, block), (_, quotient) in zip(blocks, self._blocks(quotients), strict=True):
            torch.div(block, divisor[:, columns, None], out=quotient)
        quotients.round_()
        # The clamp and the NaN fill change nothing unless a scale is subnormal (it lost
        # bits, so x / scale can pass qmax) or non-finite (x / inf is 0 or NaN): with a
        # normal scale, |x| <= absmax gives x / scale <= qmax (1 + 2^-23) < qmax + 1/2.
        # Checked on the scales alone, so the common case skips two passes over the codes;
        # on an accelerator the passes are cheaper than the checks' waits for the device.
        on_cpu = rows.device.type == "cpu"
        tiny = torch.finfo(torch.float32).tiny
        if not on_cpu or bool(((scales > 0) & (scales < tiny)).any()):
            quotients.clamp_(-self.qmax, self.qmax)
        if not on_cpu or not bool(scales.isfinite().all()):
            # NaN would be undefined as an integer; its block decodes non-finite by its scale.
            quotients.nan_to_num_(0.0)
        if self.bits == 8:
            payload.view(torch.int8).copy_(quotients)
            return scales
        # int4: byte k = (code[2k+1] + 8) << 4 | (code[2k] + 8). The codes go to bytes
        # first (a contiguous narrowing, the CPU's fastest), then pack two at a time.
        codes = torch.empty(parts, 2 * payload.shape[1], dtype=torch.int8, device=rows.device)
        if n % 2:  # the padding nibble: code 0
            codes[:, n:] = 0
        codes[:, :n].copy_(quotients)
        del quotients
        nibbles = codes.view(torch.uint8).add_(8)  # 1..15 (mod 256: -7 -> 1)
        payload.copy_(_pack_nibble_pairs(nibbles))
        return scales

    def _decode_rows(self, payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Write the float32 values of codes ``payload`` (parts, payload_bytes(n)) and
        ``scales`` (parts, num_blocks(n)) into ``out`` (parts, n) float32, contiguous."""
        n = out.shape[1]
        if self.bits == 8:
            out.copy_(payload.view(torch.int8))
        else:
            codes = _unpack_nibble_pairs(payload).sub_(8).view(torch.int8)  # -7..7
            out.copy_(codes[:, :n])  # an odd n's padding nibble is cut
        for columns, block in self._blocks(out):
            block.mul_(scales[:, columns, None])


# -------------------------------------------------------------- nibble pairs
# Two bytes (b0, b1), each 0..15, as the byte b1 << 4 | b0 and back. On a little-endian
# machine the pair is one int16, w = b1 << 8 | b0, and the packed byte is the low byte of
# (w >> 4) | w: four contiguous passes over n/2 int16 where the strided way (even and odd
# bytes as views) costs several times more. A big-endian machine takes the strided way.
LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_nibble_pairs(nibbles: torch.Tensor) -> torch.Tensor:
    """(rows, 2k) uint8, each 0..15 -> (rows, k) uint8: byte j = nibbles[2j+1] << 4 |
    nibbles[2j]."""
    if not LITTLE_ENDIAN or nibbles.shape[1] == 0:
        return nibbles[:, 1::2] * 16 + nibbles[:, 0::2]
    pairs = nibbles.view(torch.int16)  # b1 << 8 | b0, at most 0x0f0f
    return (pairs >> 4).bitwise_or_(pairs).to(torch.uint8)  # the low byte: b1 << 4 | b0


def _unpack_nibble_pairs(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack_nibble_pairs`: (rows, k) uint8 -> (rows, 2k) uint8,
    byte 2j = packed[j] & 15 and byte 2j+1 = packed[j] >> 4."""
    rows, k = packed.shape
    if not LITTLE_ENDIAN or k == 0:
        nibbles = torch.empty(rows, 2 * k, dtype=torch.uint8, device=packed.device)
        torch.bitwise_and(packed, 15, out=nibbles[:, 0::2])
        torch.bitwise_right_shift(packed, 4, out=nibbles[:, 1::2])
        return nibbles
    pairs = packed.to(torch.int16)  # 0..255
    high = (pairs << 4).bitwise_and_(0x0F00)  # the high nibble, moved to the second byte
    return high.bitwise_or_(pairs.bitwise_and_(15)).view(torch.uint8)
