"""The loss plot is a valid PNG, decoded here with zlib and struct only, and never crashes."""

from __future__ import annotations

import math
import struct
import tempfile
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_models.loss_plot import (
    _FONT,
    LINE_RGB,
    PNG_SIGNATURE,
    TEXT_RGB,
    png_bytes,
    write_loss_png,
)


class Decoded(NamedTuple):
    width: int
    height: int
    rows: list[bytes]  # 3 * width bytes per row, filter byte removed


def decode_png(data: bytes) -> Decoded:
    """Check signature, chunk order, CRCs and IHDR, then inflate IDAT back to RGB rows."""
    assert data[:8] == PNG_SIGNATURE
    chunks: list[tuple[bytes, bytes]] = []
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC on {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data)
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    assert set(kinds) == {b"IHDR", b"IDAT", b"IEND"} and chunks[-1][1] == b""
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = [raw[i * stride : (i + 1) * stride] for i in range(height)]
    assert all(row[0] == 0 for row in rows), "every row uses filter type 0"
    return Decoded(width, height, [row[1:] for row in rows])


def pixels_of(image: Decoded, rgb: tuple[int, int, int]) -> list[tuple[int, int]]:
    """(x, y) of every pixel with colour ``rgb``."""
    target = bytes(rgb)
    return [
        (x, y)
        for y, row in enumerate(image.rows)
        for x in range(image.width)
        if row[3 * x : 3 * x + 3] == target
    ]


def plot(
    tmp: Path, steps: list[int], losses: list[float], width: int = 640, height: int = 360
) -> Decoded:
    path = tmp / "loss.png"
    write_loss_png(path, steps, losses, width=width, height=height)
    return decode_png(path.read_bytes())


def test_png_bytes_round_trips_pixels_exactly() -> None:
    rows = [bytearray(b for x in range(5) for b in (x * 40 + y, y * 60, 255 - x)) for y in range(3)]
    image = decode_png(png_bytes(rows, 5, 3))
    assert (image.width, image.height) == (5, 3)
    assert image.rows == [bytes(row) for row in rows]


def test_png_bytes_rejects_rows_that_do_not_match_the_size() -> None:
    with pytest.raises(ValueError, match=r"row 1 has 5 bytes, expected 3 \* width = 6"):
        png_bytes([b"\x00" * 6, b"\x00" * 5], 2, 2)
    with pytest.raises(ValueError, match="got 1 rows for height 2"):
        png_bytes([b"\x00" * 6], 2, 2)
    with pytest.raises(ValueError, match="at least 1"):
        png_bytes([], 0, 0)


def test_a_falling_curve_is_drawn_from_top_left_to_bottom_right(tmp_path: Path) -> None:
    steps = list(range(0, 2001, 10))
    losses = [2.0 + 8.0 * math.exp(-s / 400) for s in steps]
    image = plot(tmp_path, steps, losses)
    assert (image.width, image.height) == (640, 360)
    line = pixels_of(image, LINE_RGB)
    assert line, "the line's colour appears"
    left, right = min(line), max(line)
    assert left[1] < right[1] - 100, "high loss at the first step, low at the last"
    assert len(pixels_of(image, TEXT_RGB)) > 100, "tick labels are drawn"


def test_the_declared_size_is_used(tmp_path: Path) -> None:
    image = plot(tmp_path, [0, 1, 2], [3.0, 2.0, 1.0], width=333, height=211)
    assert (image.width, image.height) == (333, 211)


@pytest.mark.parametrize("losses", [[], [math.nan, math.inf, -math.inf]])
def test_no_finite_loss_gives_empty_axes_saying_no_data(
    tmp_path: Path, losses: list[float]
) -> None:
    image = plot(tmp_path, list(range(len(losses))), losses)
    assert not pixels_of(image, LINE_RGB)
    assert pixels_of(image, TEXT_RGB), '"no data" is written'


def test_a_single_point_is_marked(tmp_path: Path) -> None:
    line = pixels_of(plot(tmp_path, [7], [3.25]), LINE_RGB)
    xs, ys = {x for x, _ in line}, {y for _, y in line}
    assert 0 < len(xs) <= 9 and 0 < len(ys) <= 9, "one small square"


def test_a_constant_loss_is_a_flat_line(tmp_path: Path) -> None:
    line = pixels_of(plot(tmp_path, list(range(100)), [1.5] * 100), LINE_RGB)
    xs, ys = {x for x, _ in line}, {y for _, y in line}
    assert max(xs) - min(xs) > 500 and max(ys) - min(ys) <= 3


def test_non_finite_losses_are_skipped(tmp_path: Path) -> None:
    with_gaps = (tmp_path / "a.png", [0, 1, 2, 3, 4], [4.0, math.nan, 3.0, math.inf, 1.0])
    without = (tmp_path / "b.png", [0, 2, 4], [4.0, 3.0, 1.0])
    for path, steps, losses in (with_gaps, without):
        write_loss_png(path, steps, losses)
    assert with_gaps[0].read_bytes() == without[0].read_bytes()


def test_unsorted_steps_are_sorted(tmp_path: Path) -> None:
    write_loss_png(tmp_path / "a.png", [2, 0, 1], [1.0, 3.0, 2.0])
    write_loss_png(tmp_path / "b.png", [0, 1, 2], [3.0, 2.0, 1.0])
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="got 2 steps and 1 losses"):
        write_loss_png(tmp_path / "x.png", [0, 1], [1.0])
    with pytest.raises(ValueError, match="at least 160x120 pixels, got width=100, height=360"):
        write_loss_png(tmp_path / "x.png", [0], [1.0], width=100)


def test_the_font_has_a_3x5_glyph_for_digits_letters_and_number_signs() -> None:
    for char in "0123456789abcdefghijklmnopqrstuvwxyz.-+e ":
        glyph = _FONT[char]
        assert len(glyph) == 5 and all(digit in "01234567" for digit in glyph)


@settings(max_examples=60, deadline=None)
@given(
    losses=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=40),
    first_step=st.integers(min_value=-(10**6), max_value=10**6),
    size=st.tuples(st.integers(160, 400), st.integers(120, 300)),
)
def test_any_losses_give_a_valid_png(
    losses: list[float], first_step: int, size: tuple[int, int]
) -> None:
    steps = list(range(first_step, first_step + len(losses)))
    with tempfile.TemporaryDirectory() as tmp:
        image = plot(Path(tmp), steps, losses, width=size[0], height=size[1])
    assert (image.width, image.height) == size
    assert bool(pixels_of(image, LINE_RGB)) == any(math.isfinite(v) for v in losses)
