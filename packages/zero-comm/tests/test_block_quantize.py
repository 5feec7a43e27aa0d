"""ZeRO++'s codec (zero_comm.block_quantize): round trip within the bound, the wire layout,
and the bytes of the plain formulas (tolerances: codec_cases.py). Where the result is
defined bit for bit, the assertion is ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from codec_cases import DTYPES, cast_slack, codec_slack, quantizers, rank_input, scale_of
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import block_quantize
from zero_comm.block_quantize import BlockQuantizer


@settings(max_examples=250)
@given(
    quantizer=quantizers(),
    parts=st.integers(1, 3),
    numel=st.integers(0, 70),
    dtype=st.sampled_from(list(DTYPES)),
    out_dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_within_half_a_scale_and_the_wire_holds_payload_plus_scales(
    quantizer: BlockQuantizer, parts: int, numel: int, dtype: str, out_dtype: str, seed: int
) -> None:
    x = rank_input(seed, 0, parts * numel, DTYPES[dtype])
    wire = quantizer.encode(x, parts=parts)
    assert wire.dtype == torch.uint8
    expected_bytes = -(-numel * quantizer.bits // 8) + 4 * -(-numel // quantizer.block_numel)
    assert quantizer.encoded_numel(numel) == expected_bytes
    assert wire.numel() == parts * expected_bytes
    y = quantizer.decode(wire, numel, parts=parts, dtype=DTYPES[out_dtype])
    assert y.dtype == DTYPES[out_dtype] and y.shape == (parts * numel,)

    rows, decoded = x.view(parts, numel), y.view(parts, numel)
    for part in range(parts):
        scale = scale_of(rows[part], quantizer).double()
        error = (rows[part].double() - decoded[part].double()).abs()
        bound = scale * (0.5 + codec_slack(quantizer.qmax))
        bound += cast_slack(DTYPES[out_dtype], decoded[part])
        assert bool((error <= bound).all()), (error - bound).max()
        # Part i is what encoding chunk i alone gives: blocks start at the chunk's start.
        alone = quantizer.quantize(rows[part])
        assert torch.equal(alone.scales, scale_of(rows[part], quantizer)[:: quantizer.block_numel])
        assert torch.equal(quantizer.dequantize(alone, DTYPES[out_dtype]), decoded[part])


@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_is_half_to_even_so_the_bound_is_reached(bits: int) -> None:
    """Scale 1 exactly (absmax = qmax): ties go to the even code, an error of exactly s/2."""
    qmax = 127 if bits == 8 else 7
    x = torch.tensor([qmax, 0.5, 1.5, 2.5, -2.5, -0.5, 3.0, -qmax])
    y = BlockQuantizer(bits, 8).decode(BlockQuantizer(bits, 8).encode(x), 8)
    assert torch.equal(y, torch.tensor([qmax, 0.0, 2.0, 2.0, -2.0, -0.0, 3.0, -qmax]))


@settings(max_examples=100)
@given(bits=st.sampled_from([8, 4]), codes=st.lists(st.integers(-127, 127), max_size=41))
def test_codes_pack_and_unpack_exactly(bits: int, codes: list[int]) -> None:
    """Integers with a block absmax of qmax have scale 1: the codes are the values, and the
    round trip is exact for int8 and for int4's two-per-byte packing, odd lengths included."""
    qmax = 127 if bits == 8 else 7
    codes = [c % (2 * qmax + 1) - qmax for c in codes]  # into -qmax..qmax
    block = 8
    values: list[int] = []
    for start in range(0, len(codes), block - 1):  # each block gets a qmax: its scale is 1
        values += [qmax, *codes[start : start + block - 1]]
    x = torch.tensor(values, dtype=torch.float32)
    quantizer = BlockQuantizer(bits, block)
    assert torch.equal(quantizer.decode(quantizer.encode(x), x.numel()), x)
    q = quantizer.quantize(x)
    assert torch.equal(q.scales, torch.ones(quantizer.num_blocks(x.numel())))
    assert torch.equal(quantizer.dequantize(q), x)


def test_the_wire_layout_is_the_documented_one() -> None:
    one = torch.tensor([1.0]).view(torch.uint8)
    # int4, block 6: codes 7 -7 1 0 3 (+ a padding 0) stored +8 as 15 1 9 8 11 (8)
    wire = BlockQuantizer(4, 6).encode(torch.tensor([7.0, -7, 1, 0, 3]))
    assert wire.tolist() == [15 | 1 << 4, 9 | 8 << 4, 11 | 8 << 4, *one.tolist()]
    # int8, block 2: one byte per code (two's complement), then one float32 per block
    wire = BlockQuantizer(8, 2).encode(torch.tensor([127.0, -1, 0, 0, 254]))
    scales = torch.tensor([1.0, 0.0, 2.0]).view(torch.uint8).tolist()
    assert wire.tolist() == [127, 255, 0, 0, 127, *scales]


def test_zero_blocks_decode_to_zeros_and_non_finite_blocks_stay_non_finite() -> None:
    quantizer = BlockQuantizer(8, 4)
    x = torch.tensor([0.0, 0, 0, 0, 1, float("nan"), 2, 3, 1, float("inf"), 0, 0, 5, 6, 7, 8])
    y = quantizer.decode(quantizer.encode(x), x.numel())
    assert torch.equal(y[:4], torch.zeros(4)) and quantizer.quantize(x).scales[0] == 0
    assert not torch.isfinite(y[4:12]).any(), "an overflow must not be hidden by the codec"
    assert torch.allclose(y[12:], x[12:], rtol=0, atol=8 / 127 / 2 * 1.001)


def reference_encode(quantizer: BlockQuantizer, x: torch.Tensor, parts: int) -> torch.Tensor:
    """The module docstring's formulas, written plainly (zero padding, ``abs().amax()``,
    one cast per step): the bytes the codec must send, whatever its speed tricks."""
    qmax, block = quantizer.qmax, quantizer.block_numel
    n = x.numel() // parts
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    rows = x.reshape(parts, n).to(torch.float32)
    blocks_per_row = -(-n // block)
    padded = torch.zeros(parts, blocks_per_row * block)
    padded[:, :n] = rows
    blocks = padded.view(-1, block)
    scales = blocks.abs().amax(dim=1) / qmax
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = (blocks / divisor[:, None]).round().clamp(-qmax, qmax).nan_to_num(0.0)
    codes = codes.to(torch.int8).view(parts, -1)
    if quantizer.bits == 8:
        payload = codes.view(torch.uint8)[:, :n]
    else:  # int4 blocks are even, so the padded row is whole bytes; padding codes are 0
        nibbles = (codes + 8).to(torch.uint8).view(parts, -1, 2)
        payload = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4))[:, : quantizer.payload_bytes(n)]
    scale_bytes = scales.view(parts, blocks_per_row).contiguous().view(torch.uint8)
    return torch.cat([payload, scale_bytes], dim=1).reshape(-1)


def reference_decode(
    quantizer: BlockQuantizer, wire: torch.Tensor, n: int, parts: int
) -> torch.Tensor:
    """The inverse of reference_encode, as plainly: float32 (parts * n,)."""
    if n == 0:
        return torch.empty(0)
    block, blocks_per_row = quantizer.block_numel, quantizer.num_blocks(n)
    rows = wire.view(parts, -1)
    split = quantizer.payload_bytes(n)
    scales = rows[:, split:].reshape(-1).clone().view(torch.float32).reshape(-1, 1)
    if quantizer.bits == 8:
        codes = rows[:, :split].view(torch.int8).to(torch.float32)
    else:
        payload = rows[:, :split]
        low_high = torch.stack([payload & 15, payload >> 4], dim=2).reshape(parts, -1)
        codes = low_high[:, :n].to(torch.float32) - 8
    padded = torch.zeros(parts, blocks_per_row * block)
    padded[:, :n] = codes
    return (padded.view(-1, block) * scales).view(parts, -1)[:, :n].reshape(-1)


@settings(max_examples=150, deadline=None)
@given(
    quantizer=quantizers(),
    parts=st.integers(1, 4),
    numel=st.integers(0, 90),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
    specials=st.lists(
        st.tuples(st.integers(0, 359), st.sampled_from([0.0, -0.0, "nan", "inf", "-inf"])),
        max_size=6,
    ),
    magnitude=st.sampled_from([1.0, 1.0, 2.0**-135, 2.0**-143]),
    little_endian=st.booleans(),
)
def test_the_codec_sends_the_bytes_of_the_plain_formulas_and_decodes_them_alike(
    quantizer: BlockQuantizer,
    parts: int,
    numel: int,
    dtype: str,
    seed: int,
    specials: list[tuple[int, Any]],
    magnitude: float,
    little_endian: bool,
) -> None:
    """The codec computes absmax as max(max, -min), divides block views in place, packs
    int4 in float32 and decodes into its output (no padding copies, no temporaries per
    step): every byte on the wire and every decoded bit must still be the plain formulas'
    (signed zeros, NaN, infinities and all-zero blocks included), since they are what
    the bounds and the cross-backend tests were proven on. ``magnitude`` moves whole
    inputs to where the scales are subnormal (where the codec must clamp, which it skips
    for normal scales); ``little_endian=False`` runs the nibble packing a big-endian
    machine takes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_quantize, "LITTLE_ENDIAN", little_endian)
        x = (rank_input(seed, 0, parts * numel, torch.float64) * magnitude).to(DTYPES[dtype])
        for position, value in specials:
            if position < x.numel():
                x[position] = float(value)
        wire = quantizer.encode(x, parts=parts)
        assert torch.equal(wire, reference_encode(quantizer, x, parts))
        decoded = quantizer.decode(wire, numel, parts=parts)
        expected = reference_decode(quantizer, wire, numel, parts)
        assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))
        into = torch.empty(parts * numel)
        assert quantizer.decode(wire, numel, parts=parts, out=into).data_ptr() == into.data_ptr()
        assert torch.equal(into.view(torch.int32), expected.view(torch.int32))
        if parts == 1:
            q = quantizer.quantize(x)
            assert torch.equal(torch.cat([q.payload, q.scales.view(torch.uint8)]), wire)


def test_a_subnormal_scale_is_clamped_to_qmax() -> None:
    """int8: 190 * 2^-149 / 127 rounds to the smallest subnormal, 2^-149, so the quotient
    of 190 * 2^-149 is 190 (int4: 10 * 2^-149 / 7, quotient 10); the codec must clamp it to
    qmax, though it skips the clamp where every scale is normal."""
    for bits, multiple in ((8, 190), (4, 10)):
        x = torch.tensor([multiple, -multiple, 1]) * 2.0**-149
        quantizer = BlockQuantizer(bits, 4)
        q = quantizer.quantize(x)
        assert q.scales.item() == 2.0**-149
        codes = quantizer.dequantize(q) / q.scales
        assert codes.tolist() == [quantizer.qmax, -quantizer.qmax, 1]
        assert torch.equal(quantizer.encode(x), reference_encode(quantizer, x, 1))


def test_bad_configurations_are_named() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        BlockQuantizer(3, 8)
    with pytest.raises(ValueError, match=r"even.*use 6"):
        BlockQuantizer(4, 5)
    with pytest.raises(ValueError, match="block_numel=0"):
        BlockQuantizer(8, 0)
    with pytest.raises(TypeError, match=r"cannot quantize torch\.float64"):
        BlockQuantizer(8, 4).encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not split into parts=3"):
        BlockQuantizer(8, 4).encode(torch.zeros(4), parts=3)
    with pytest.raises(ValueError, match="expected 16"):
        BlockQuantizer(8, 4).decode(torch.zeros(11, dtype=torch.uint8), 8)


def test_encoding_takes_a_parameter_and_decoding_refuses_to_overwrite_its_wire() -> None:
    quantizer = BlockQuantizer(4, 4)
    weight = torch.nn.Parameter(torch.arange(8.0))
    wire = quantizer.encode(weight)  # raised before: out= ops refuse autograd inputs
    assert torch.equal(
        quantizer.decode(wire, 8), quantizer.decode(quantizer.encode(weight.data), 8)
    )
    assert quantizer.quantize(weight).numel == 8
    storage = torch.zeros(64, dtype=torch.uint8)
    storage[: wire.numel()] = wire
    with pytest.raises(ValueError, match="shares memory with the wire"):
        quantizer.decode(storage[: wire.numel()], 8, out=storage[32:].view(torch.float32)[:8])
    with pytest.raises(TypeError, match="decode: out must be"):
        quantizer.decode(wire, 8, out=torch.zeros(8, dtype=torch.int32))
