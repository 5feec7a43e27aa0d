"""Loss curves as PNG files, drawn with the standard library alone (no matplotlib).

:func:`write_loss_png` draws loss against step: a white background, left and bottom axes,
horizontal grid lines labelled with their loss values, labelled step ticks, the curve in
:data:`LINE_RGB` and a title. Non-finite losses are skipped; with no finite loss at all the axes
say "no data". Text uses a built-in 3x5 bitmap font, scaled up with the image (x2 at 640x360).

Grid lines sit at multiples of a "nice" step (1, 2 or 5 times a power of ten) chosen so the loss
range spans 2 to 4 steps; the same idea as matplotlib's ``MaxNLocator``. Losses are clamped to
``+-1e300`` first, so no span, pad or tick can overflow a float.

:func:`png_bytes` is the encoder: 8-bit RGB (colour type 2), filter type 0 on every row, one
zlib-compressed IDAT chunk, and a CRC-32 over each chunk's type and data (PNG specification,
ISO/IEC 15948, sections 5.3 and 11.2).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

RGB = tuple[int, int, int]

BACKGROUND_RGB: RGB = (255, 255, 255)
AXIS_RGB: RGB = (0, 0, 0)
GRID_RGB: RGB = (220, 220, 220)
TEXT_RGB: RGB = (40, 40, 40)
LINE_RGB: RGB = (31, 119, 180)
MIN_WIDTH, MIN_HEIGHT = 160, 120
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_LIMIT = 1e300

# 3x5 glyphs: one octal digit per row, top to bottom; 4 is the left column, 1 the right.
# Letters are small capitals; characters not listed are drawn as '?'.
_CHARS = " 0123456789abcdefghijklmnopqrstuvwxyz.-+:_/()?,"
_CODES = (
    "00000 75557 26227 71747 71317 55711 74717 74757 71122 75757 75717 "
    "25755 65656 34443 65556 74647 74644 34553 55755 72227 11152 55655 44447 57755 "
    "65555 25552 65644 25563 65655 34216 72222 55557 55552 55775 55255 55222 71247 "
    "00002 00700 02720 02020 00007 11244 12221 42224 71202 00024"
)
_FONT = dict(zip(_CHARS, _CODES.split(), strict=True))


def png_bytes(pixels: Sequence[bytes | bytearray], width: int, height: int) -> bytes:
    """Encode ``height`` rows of ``3 * width`` bytes (R, G, B per pixel) as a PNG file."""
    if width < 1 or height < 1:
        raise ValueError(f"png_bytes: width and height must be at least 1, got {width}x{height}")
    if len(pixels) != height:
        raise ValueError(f"png_bytes: got {len(pixels)} rows for height {height}; pass one per row")
    for i, row in enumerate(pixels):
        if len(row) != 3 * width:
            raise ValueError(
                f"png_bytes: row {i} has {len(row)} bytes, expected 3 * width = {3 * width} (RGB)"
            )
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)  # filter type 0 (None) per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # depth 8, RGB, no interlace
    return (
        PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    """Length, type, data, then the CRC-32 of type and data, all integers big-endian."""
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


class _Canvas:
    """RGB pixels as one bytearray per row; drawing outside the image is clipped."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(BACKGROUND_RGB) * width for _ in range(height)]

    def rect(self, x: int, y: int, w: int, h: int, rgb: RGB) -> None:
        x0, x1 = max(x, 0), min(x + w, self.width)
        if x0 < x1:
            span = bytes(rgb) * (x1 - x0)
            for row in self.rows[max(y, 0) : max(min(y + h, self.height), 0)]:
                row[3 * x0 : 3 * x1] = span

    def line(self, a: tuple[int, int], b: tuple[int, int], rgb: RGB, pen: int) -> None:
        """Bresenham's line from ``a`` to ``b`` with a square pen ``pen`` pixels wide."""
        (x, y), (x1, y1) = a, b
        dx, dy = abs(x1 - x), -abs(y1 - y)
        sx, sy = (1 if x < x1 else -1), (1 if y < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x - pen // 2, y - pen // 2, pen, pen, rgb)
            if x == x1 and y == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x = err + dy, x + sx
            if e2 <= dx:
                err, y = err + dx, y + sy

    def text(self, x: int, y: int, text: str, rgb: RGB, scale: int) -> None:
        """Draw ``text`` with its top-left corner at (x, y), each font pixel scale x scale."""
        for i, char in enumerate(text.lower()):
            for r, digit in enumerate(_FONT.get(char, _FONT["?"])):
                for c in range(3):
                    if int(digit) & (4 >> c):
                        self.rect(x + (4 * i + c) * scale, y + r * scale, scale, scale, rgb)


def _text_width(text: str, scale: int) -> int:
    return max(4 * len(text) - 1, 0) * scale


def _nice(x: float) -> float:
    """The smallest of 1, 2, 5 or 10 times a power of ten that is at least ``x > 0``."""
    power = 10.0 ** math.floor(math.log10(x))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= x * (1 - 1e-9))


def _loss_ticks(values: Sequence[float], parts: int) -> tuple[list[float], float]:
    """Grid values (ascending; the first and last bound the axis) and their step: the range
    split into about ``parts`` (up to 2.5 times fewer) intervals of a nice step."""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-6 * max(abs(lo), abs(hi)) or hi - lo < 1e-290:  # constant to the eye
        pad = abs(hi) * 0.1 if abs(hi) > 1e-280 else 1.0
        lo, hi = lo - pad, hi + pad
    low, high = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    if lo >= 0:
        low = max(low, 0.0)  # a non-negative loss gets no negative axis
    step = _nice((high - low) / parts)
    ticks = [k * step + 0.0 for k in range(math.floor(low / step), math.ceil(high / step) + 1)]
    return ticks, step


def _loss_labels(values: Sequence[float], step: float) -> list[str]:
    """Labels with just enough digits to tell values ``step`` apart: fixed, else 1.5e-7."""
    exp_step = math.floor(math.log10(step) + 1e-9)
    top = max(abs(v) for v in values)
    if top < 1e6 and (exp_step >= -4 or top >= 1e-2):
        return [f"{v:.{max(0, -exp_step)}f}" for v in values]
    digits = max(0, math.floor(math.log10(top)) - exp_step) if top > 0 else 0
    labels = []
    for v in values:
        mantissa, exponent = f"{v:.{digits}e}".split("e")
        labels.append("0" if v == 0 else f"{mantissa}e{int(exponent)}")
    return labels


def _step_ticks(lo: int, hi: int, room: int, scale: int) -> list[int]:
    """Up to six ticks at multiples of a nice integer step whose labels fit in ``room`` px."""
    ticks: list[int] = []
    for target in (6, 5, 4, 3, 2, 1):
        step = max(1, round(_nice((hi - lo) / target)))
        ticks = list(range(-(-lo // step) * step, hi + 1, step))
        widest = max((_text_width(str(t), scale) for t in ticks), default=0)
        if len(ticks) * (widest + 8 * scale) <= room:
            break
    return ticks


def write_loss_png(
    path: str | os.PathLike[str],
    steps: Sequence[int],
    losses: Sequence[float],
    *,
    title: str = "training loss",
    width: int = 640,
    height: int = 360,
) -> None:
    """Write a line chart of ``losses`` against ``steps`` to ``path`` as a PNG file.

    Points are sorted by step; NaN and infinite losses are skipped. Text scales with the image:
    one font pixel is ``min(width // 320, height // 180)`` image pixels, at least 1.
    """
    if len(steps) != len(losses):
        raise ValueError(
            f"write_loss_png: steps and losses must have the same length, "
            f"got {len(steps)} steps and {len(losses)} losses"
        )
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        raise ValueError(
            f"write_loss_png: the image must be at least {MIN_WIDTH}x{MIN_HEIGHT} pixels, "
            f"got width={width}, height={height}; pass a larger width and height"
        )
    points = sorted(
        (int(s), min(max(float(v), -_LIMIT), _LIMIT))
        for s, v in zip(steps, losses, strict=True)
        if math.isfinite(v)
    )
    s = max(1, min(width // 320, height // 180))  # image pixels per font pixel
    glyph_h, pen = 5 * s, s + 1
    canvas = _Canvas(width, height)
    y0, y1 = 13 * s + 5 * (s + 1), height - 20 * s
    parts = max(2, min(6, (y1 - y0) // (4 * glyph_h)))  # grid lines at least 4 labels apart
    if points:
        y_ticks, y_step = _loss_ticks([v for _, v in points], parts)
        y_labels = _loss_labels(y_ticks, y_step)
    else:
        y_ticks, y_labels = [], []
    y_lo, y_hi = (y_ticks[0], y_ticks[-1]) if y_ticks else (0.0, 1.0)
    x0, x1 = 7 * s + max((_text_width(t, s) for t in y_labels), default=0), width - 12 * s
    lo_s = points[0][0] if points else 0
    hi_s = max(points[-1][0] if points else 1, lo_s + 1)  # one step: no zero division
    if points and points[0][0] == points[-1][0]:
        lo_s, hi_s = lo_s - 1, lo_s + 1  # a single step is drawn in the middle

    def to_x(step: int) -> int:
        return x0 + 3 * s + round((step - lo_s) / (hi_s - lo_s) * (x1 - x0 - 6 * s))

    def to_y(loss: float) -> int:
        return y1 - round((loss - y_lo) / (y_hi - y_lo) * (y1 - y0))

    for value, label in zip(y_ticks, y_labels, strict=True):
        y = to_y(value)
        canvas.rect(x0, y, x1 - x0 + 1, 1, GRID_RGB)
        canvas.text(x0 - 3 * s - _text_width(label, s), y - glyph_h // 2, label, TEXT_RGB, s)
    if points:
        for tick in _step_ticks(lo_s, hi_s, x1 - x0, s):
            x, label = to_x(tick), str(tick)
            canvas.rect(x - s // 2, y1, s, 2 * s, AXIS_RGB)
            canvas.text(x - _text_width(label, s) // 2, y1 + 4 * s, label, TEXT_RGB, s)
    canvas.rect(x0, y0, 1, y1 - y0 + 1, AXIS_RGB)
    canvas.rect(x0, y1, x1 - x0 + 1, 1, AXIS_RGB)
    xlabel = "step" if points else "no data"
    xlabel_y = y1 + 7 * s + glyph_h if points else (y0 + y1 - glyph_h) // 2
    canvas.text((x0 + x1 - _text_width(xlabel, s)) // 2, xlabel_y, xlabel, TEXT_RGB, s)
    # Many points per pixel column collapse to its first, lowest, highest and last point: the
    # same pixels as every segment, but at most four per column to draw.
    columns: dict[int, list[int]] = {}
    for step, loss in points:
        x, y = to_x(step), to_y(loss)
        column = columns.setdefault(x, [y, y, y, y])
        column[1:] = [min(column[1], y), max(column[2], y), y]
    polyline = [(x, y) for x, column in columns.items() for y in column]
    for a, b in itertools.pairwise(polyline):
        canvas.line(a, b, LINE_RGB, pen)
    if 0 < len(points) <= 25:  # few points: mark each one
        for step, loss in points:
            canvas.rect(to_x(step) - pen, to_y(loss) - pen, 2 * pen + 1, 2 * pen + 1, LINE_RGB)
    t = s + 1
    canvas.text(max(4 * s, (width - _text_width(title, t)) // 2), 4 * s, title, AXIS_RGB, t)
    Path(path).write_bytes(png_bytes(canvas.rows, width, height))
