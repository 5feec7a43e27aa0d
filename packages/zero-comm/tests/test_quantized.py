"""ZeRO++'s codec (block_quantize.py) and its collectives qwZ and qgZ (quantized.py).

Tolerances. The codec's error per element is half its block's scale s = absmax / qmax,
plus float32 rounding: the quotient x / s is rounded once before ``round`` and the decoded
code * s once after, each at most qmax * s * 2^-24, so ``CODEC_SLACK(qmax) * s`` covers
both; decoding into bfloat16 or float16 adds half an ulp of that dtype (``cast_slack``).
qgZ's bound is derived in ``qgz_bound``. Where the result is defined bit for bit (a part
of the gather is the codec's round trip of that shard; qgZ is a fixed sequence of codec
round trips and float32 additions), the assertion is ``torch.equal``.
"""

from __future__ import annotations

import hashlib
import warnings
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zero_comm
from zero_comm import Communicator, run_simulated
from zero_comm import quantized as quantized_module
from zero_comm.block_quantize import BlockQuantizer
from zero_comm.quantized import (
    QuantizationFallbackWarning,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from zero_comm.simulated import SimulatedRankError
from zero_comm.testing import find_mpiexec, run_on_ranks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
U = 2.0**-24  # float32's unit roundoff


def codec_slack(qmax: int) -> float:
    """Float32 rounding of encode and decode, in units of the block's scale."""
    return (2 * qmax + 1) * U


def cast_slack(dtype: torch.dtype, value: torch.Tensor) -> torch.Tensor:
    """At least half an ulp of ``dtype`` at ``value`` (0 for float32, decoded in float32)."""
    if dtype == torch.float32:
        return torch.zeros_like(value, dtype=torch.float64)
    info = torch.finfo(dtype)
    return value.double().abs() * info.eps + info.tiny * info.eps


def quantizers() -> st.SearchStrategy[BlockQuantizer]:
    def build(bits: int, block: int) -> BlockQuantizer:
        return BlockQuantizer(bits, block + block % 2 if bits == 4 else block)  # int4: even

    return st.builds(build, st.sampled_from([8, 4]), st.integers(1, 40))


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spread over 2^-12..2^8 within blocks, with runs of zeros (all-zero blocks)."""
    generator = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(numel, generator=generator, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-12, 9, (numel,), generator=generator).double()
    if numel:
        start = int(torch.randint(0, numel, (1,), generator=generator))
        x[start : start + int(torch.randint(0, 12, (1,), generator=generator))] = 0
    return x.to(dtype)


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the float32 absmax of its block (blocks from the start of ``x``)."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32)
    padded[:n] = x.float().abs()
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


def scale_of(x: torch.Tensor, quantizer: BlockQuantizer) -> torch.Tensor:
    """Per element, its block's scale, as the codec defines it: float32 absmax / qmax."""
    return block_absmax(x, quantizer.block_numel) / quantizer.qmax


def node_groups(comm: Communicator, per_node: int) -> tuple[Communicator, Communicator]:
    """(intra, inter) for node-major ranks: node = rank // per_node."""
    intra = comm.split(color=comm.rank // per_node)
    inter = comm.split(color=comm.rank % per_node)
    return intra, inter


# ------------------------------------------------------------------------- the codec
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
)
def test_the_codec_sends_the_bytes_of_the_plain_formulas_and_decodes_them_alike(
    quantizer: BlockQuantizer,
    parts: int,
    numel: int,
    dtype: str,
    seed: int,
    specials: list[tuple[int, Any]],
) -> None:
    """The codec computes absmax as max(max, -min), divides block views in place, packs
    int4 in float32 and decodes into its output (no padding copies, no temporaries per
    step): every byte on the wire and every decoded bit must still be the plain formulas'
    (signed zeros, NaN, infinities and all-zero blocks included), since they are what
    the bounds and the cross-backend tests were proven on."""
    x = rank_input(seed, 0, parts * numel, DTYPES[dtype])
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


# ---------------------------------------------------------------------------- qwZ
@settings(max_examples=30)
@given(
    world_size=st.integers(1, 8),
    quantizer=quantizers(),
    numel=st.integers(0, 40),
    dtype=st.sampled_from(list(DTYPES)),
    async_op=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_all_gather_is_the_codec_round_trip_of_every_shard_on_every_rank(
    world_size: int,
    quantizer: BlockQuantizer,
    numel: int,
    dtype: str,
    async_op: bool,
    seed: int,
) -> None:
    shards = [rank_input(seed, r, numel, DTYPES[dtype]) for r in range(world_size)]

    def body(comm: Communicator) -> tuple[torch.Tensor, Fraction, int]:
        output = torch.full((world_size * numel,), float("nan"), dtype=DTYPES[dtype])
        if async_op:
            handle = quantized_all_gather(
                comm, output, shards[comm.rank], quantizer, async_op=True, label="w"
            )
            handle.wait()
        else:
            quantized_all_gather(comm, output, shards[comm.rank], quantizer, label="w")
        gather = comm.stats["all_gather"]
        return output, gather.volume_bytes, gather.calls

    # defer_outputs: an async gather's bytes land only at wait(), so decoding early shows.
    results = run_simulated(world_size, body, defer_outputs=True)
    first = results[0][0]
    for output, volume, calls in results:
        assert torch.equal(output, first), "ranks hold different bits"
        assert volume == (world_size - 1) * quantizer.encoded_numel(numel)
        assert calls == (1 if world_size > 1 else 0)
    exact = torch.cat(shards)
    if world_size == 1:
        assert torch.equal(first, exact), "nothing moves at N = 1, so nothing is quantized"
        return
    for r, part in enumerate(first.view(world_size, numel)):
        own = quantizer.decode(quantizer.encode(shards[r]), numel, dtype=DTYPES[dtype])
        assert torch.equal(part, own)
    error = (first.double() - exact.double()).abs()
    scale = torch.cat([scale_of(s, quantizer) for s in shards]).double()
    bound = scale * (0.5 + codec_slack(quantizer.qmax)) + cast_slack(DTYPES[dtype], first)
    assert bool((error <= bound).all())


# ---------------------------------------------------------------------------- qgZ
def reference_qgz(
    inputs: list[torch.Tensor], quantizer: BlockQuantizer, nodes: int, per_node: int, rank: int
) -> torch.Tensor:
    """The documented algorithm in one process, for rank ``rank``'s chunk: each node's
    partial is the local-rank-order float32 sum of its ranks' decoded chunks (unquantized
    if one rank per node); the result is the node-order sum of the decoded partials (the
    partial itself if one node); N = 1 copies."""
    size = nodes * per_node
    chunks = [x.view(size, -1)[rank] for x in inputs]
    numel = chunks[0].numel()
    if size == 1:
        return chunks[0].clone()

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return quantizer.decode(quantizer.encode(x), numel)

    partials = []
    for node in range(nodes):
        mine = chunks[node * per_node : (node + 1) * per_node]
        if per_node == 1:
            partials.append(mine[0].float())
            continue
        partial = round_trip(mine[0])
        for chunk in mine[1:]:
            partial += round_trip(chunk)
        partials.append(partial)
    if nodes == 1:
        return partials[0].to(inputs[0].dtype)
    total = round_trip(partials[0])
    for partial in partials[1:]:
        total += round_trip(partial)
    return total.to(inputs[0].dtype)


def qgz_bound(
    inputs: list[torch.Tensor],
    quantizer: BlockQuantizer,
    nodes: int,
    per_node: int,
    rank: int,
    result: torch.Tensor,
) -> torch.Tensor:
    """Per element, the most qgZ may differ from the exact (float64) sum.

    Stage 1 (if S > 1) errs by at most s_r / 2 per contribution r (its block's scale).
    Stage 2 (if M > 1) errs by s_P / 2 per node partial P; every decoded value is at most
    its block's absmax (|code| <= qmax), so a partial's absmax, hence s_P, is at most the
    sum of its contributions' scales (up to float32 rounding). So each stage that runs
    adds at most sum_r s_r / 2. Float32 rounding (codec slack per quantization, and at most
    N + M additions each within U of a value no larger than sum_r absmax_r) is bounded by
    4 (N + 2)^2 U * sum_r absmax_r: under 1% of the main term for N <= 8, so the bound is
    still tight enough to fail on a wrong sum. Then the output's own rounding.
    """
    size = nodes * per_node
    chunks = [x.view(size, -1)[rank] for x in inputs]
    scales = sum(scale_of(c, quantizer).double() for c in chunks)
    absmax = sum(block_absmax(c, quantizer.block_numel).double() for c in chunks)
    stages = int(per_node > 1) + int(nodes > 1)
    bound = stages * scales / 2 + 4 * (size + 2) ** 2 * U * absmax
    return bound + cast_slack(result.dtype, result)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int]:
    """(nodes, ranks per node) with at most 8 ranks."""
    per_node = draw(st.integers(1, 4))
    return draw(st.integers(1, 8 // per_node)), per_node


@settings(max_examples=40)
@given(
    layout=layouts(),
    quantizer=quantizers(),
    chunk=st.integers(0, 30),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_quantized_reduce_scatter_is_the_documented_sum_within_the_bound(
    layout: tuple[int, int], quantizer: BlockQuantizer, chunk: int, dtype: str, seed: int
) -> None:
    nodes, per_node = layout
    size = nodes * per_node
    inputs = [rank_input(seed, r, size * chunk, DTYPES[dtype]) for r in range(size)]

    def body(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor, Fraction, Fraction]:
        intra, inter = node_groups(comm, per_node)
        outputs = []
        for _ in range(2):  # twice: the same bits again
            output = torch.full((chunk,), float("nan"), dtype=DTYPES[dtype])
            quantized_reduce_scatter(
                intra, inter, output, inputs[comm.rank], quantizer, world=comm, label="g"
            )
            outputs.append(output)
        return (
            outputs[0],
            outputs[1],
            intra.stats["all_to_all"].volume_bytes,
            inter.stats["all_to_all"].volume_bytes,
        )

    encoded = quantizer.encoded_numel(chunk)
    for rank, (first, again, intra_bytes, inter_bytes) in enumerate(run_simulated(size, body)):
        assert torch.equal(first, again), "a repeated reduction gave other bits"
        assert torch.equal(first, reference_qgz(inputs, quantizer, nodes, per_node, rank))
        exact = sum(x.view(size, -1)[rank].double() for x in inputs)
        error = (first.double() - exact).abs()
        bound = qgz_bound(inputs, quantizer, nodes, per_node, rank, first)
        assert bool((error <= bound).all()), (error - bound).max()
        # Bytes as sent, twice (two calls), in the ring convention of each group.
        assert intra_bytes == 2 * Fraction((per_node - 1) * size * encoded, per_node)
        assert inter_bytes == 2 * (nodes - 1) * encoded


@settings(max_examples=25, deadline=None)
@given(
    layout=layouts(),
    launches=st.integers(1, 4),
    orders=st.lists(st.permutations(range(4)), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_asynchronous_qgz_gives_the_same_bits_whatever_order_each_rank_waits_in(
    layout: tuple[int, int], launches: int, orders: list[list[int]], seed: int
) -> None:
    """Each rank launches several reductions with ``async_op=True`` (each with its own
    label, so the consistency check compares every collective's order across ranks) and
    waits for them in an order of its own. A wait issues the inter-node stage, so without
    the handles' issue order the ranks' inter-node all-to-alls would pair different
    reductions: the check would raise, or the sums would mix."""
    nodes, per_node = layout
    size, chunk, quantizer = nodes * per_node, 24, BlockQuantizer(4, 8)
    inputs = [
        [rank_input(seed + k, r, size * chunk, torch.float32) for k in range(launches)]
        for r in range(size)
    ]

    def body(comm: Communicator) -> list[torch.Tensor]:
        intra, inter = node_groups(comm, per_node)
        outputs = [torch.full((chunk,), float("nan")) for _ in range(launches)]
        handles = [
            quantized_reduce_scatter(
                intra,
                inter,
                outputs[k],
                inputs[comm.rank][k],
                quantizer,
                world=comm,
                async_op=True,
                label=f"g{k}",
            )
            for k in range(launches)
        ]
        for k in (k for k in orders[comm.rank] if k < launches):
            handles[k].wait()
            assert handles[k].is_completed()
        return outputs

    # defer_outputs: the intra-node all-to-all's bytes land only at its wait, so a wait()
    # that summed before waiting for it would read garbage.
    for rank, outputs in enumerate(run_simulated(size, body, defer_outputs=True)):
        for k, output in enumerate(outputs):
            launch_inputs = [inputs[r][k] for r in range(size)]
            assert torch.equal(
                output, reference_qgz(launch_inputs, quantizer, nodes, per_node, rank)
            )


def test_a_failed_wait_stays_failed_and_leaves_the_handles_after_it_in_order() -> None:
    """A wait that raises (say out of memory while decoding) leaves its output undefined:
    waiting again says so instead of re-running it after later handles, and the handles
    issued after it still complete, in issue order."""
    from collections import deque

    from zero_comm.quantized import QuantizedHandle

    done: list[str] = []
    order: deque[QuantizedHandle] = deque()

    def fails() -> None:
        raise MemoryError("decode")

    first = QuantizedHandle(None, fails, order)
    second = QuantizedHandle(None, lambda: done.append("second"), order)
    third = QuantizedHandle(None, lambda: done.append("third"), order)
    with pytest.raises(MemoryError):
        third.wait()  # completes first (raises) before it
    with pytest.raises(RuntimeError, match=r"failed before .*MemoryError: decode"):
        first.wait()
    assert done == [] and list(order) == [second, third]
    third.wait()
    assert done == ["second", "third"] and not order
    assert second.is_completed() and not first.is_completed()


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


def test_the_qgz_bound_is_not_vacuous() -> None:
    """At 2 x 2 with int4, the error reaches a sizeable part of the bound: a bound many
    times too loose would let a wrong sum pass."""
    quantizer, chunk = BlockQuantizer(4, 16), 64
    inputs = [rank_input(3, r, 4 * chunk, torch.float32) for r in range(4)]

    def body(comm: Communicator) -> torch.Tensor:
        intra, inter = node_groups(comm, 2)
        output = torch.empty(chunk)
        quantized_reduce_scatter(intra, inter, output, inputs[comm.rank], quantizer)
        return output

    worst = 0.0
    for rank, output in enumerate(run_simulated(4, body)):
        exact = sum(x.view(4, -1)[rank].double() for x in inputs)
        ratio = (output.double() - exact).abs() / qgz_bound(inputs, quantizer, 2, 2, rank, output)
        worst = max(worst, float(ratio.max()))
    assert 0.1 < worst <= 1.0


# ------------------------------------------------------------------------ fallback
@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which fallback reasons this process has warned about."""
    monkeypatch.setattr(quantized_module, "_WARNED", set())


def test_an_unsupported_dtype_is_an_error_unless_the_fallback_is_allowed_then_warns_once(
    fresh_warnings: None,
) -> None:
    quantizer = BlockQuantizer(8, 4)
    shards = [torch.arange(5, dtype=torch.float64) + 10 * r for r in range(2)]

    def refused(comm: Communicator) -> None:
        output = torch.empty(10, dtype=torch.float64)
        quantized_all_gather(comm, output, shards[comm.rank], quantizer)

    with pytest.raises(SimulatedRankError) as info:
        run_simulated(2, refused)
    assert isinstance(info.value.__cause__, ValueError)
    assert "float64 is not quantized" in str(info.value.__cause__)
    assert "allow_fallback=True" in str(info.value.__cause__)

    def allowed(comm: Communicator) -> list[torch.Tensor]:
        outputs = []
        for _ in range(2):
            output = torch.empty(10, dtype=torch.float64)
            quantized_all_gather(comm, output, shards[comm.rank], quantizer, allow_fallback=True)
            outputs.append(output)
        return outputs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_simulated(2, allowed)
    fallbacks = [w for w in caught if issubclass(w.category, QuantizationFallbackWarning)]
    assert len(fallbacks) == 1, "two ranks x two calls: one warning for one reason"
    assert "float64 is not quantized" in str(fallbacks[0].message)
    for outputs in results:
        assert all(torch.equal(o, torch.cat(shards)) for o in outputs), "not the exact gather"


def test_quantized_reduce_scatter_falls_back_only_when_allowed_and_given_the_world(
    fresh_warnings: None,
) -> None:
    quantizer = BlockQuantizer(8, 4)
    inputs = [torch.arange(8, dtype=torch.float64) * (r + 1) for r in range(4)]

    def run(world: bool, allow: bool, dtype: torch.dtype, wrong_groups: bool) -> Any:
        def body(comm: Communicator) -> torch.Tensor:
            intra, inter = node_groups(comm, 2)
            if wrong_groups:  # 2 x 1 ranks where the world has 4
                inter = comm.split(color=comm.rank)
            output = torch.empty(2, dtype=dtype)
            quantized_reduce_scatter(
                intra, inter, output, inputs[comm.rank].to(dtype), quantizer,
                world=comm if world else None, allow_fallback=allow,
            )  # fmt: skip
            return output

        return run_simulated(4, body)

    exact = torch.stack(inputs).sum(dim=0)
    for dtype, wrong, reason in [
        (torch.float64, False, "float64 is not quantized"),
        (torch.float32, True, "do not place this rank where world has it"),
    ]:
        with pytest.raises(SimulatedRankError) as info:
            run(world=True, allow=False, dtype=dtype, wrong_groups=wrong)
        assert reason in str(info.value.__cause__) and "Fix:" in str(info.value.__cause__)
        with pytest.raises(SimulatedRankError) as info:
            run(world=False, allow=True, dtype=dtype, wrong_groups=wrong)
        # Without world, groups that do not make up the world cannot be told from an
        # input of the wrong size: that is the error then.
        expected = "must hold 4 elements" if wrong else "needs world="
        assert expected in str(info.value.__cause__)
        with pytest.warns(QuantizationFallbackWarning, match=reason):
            results = run(world=True, allow=True, dtype=dtype, wrong_groups=wrong)
        for rank, output in enumerate(results):
            assert torch.equal(output.double(), exact.view(4, 2)[rank])


def test_mismatched_sizes_are_errors_not_fallbacks() -> None:
    quantizer = BlockQuantizer(8, 4)

    def body(comm: Communicator) -> None:
        intra, inter = node_groups(comm, 2)
        with pytest.raises(ValueError, match="must hold 8 elements"):
            quantized_reduce_scatter(
                intra, inter, torch.empty(2), torch.empty(9), quantizer, allow_fallback=True
            )
        with pytest.raises(TypeError, match=r"output is torch\.float16 but input"):
            quantized_reduce_scatter(
                intra, inter, torch.empty(2, dtype=torch.float16), torch.empty(8), quantizer
            )
        with pytest.raises(ValueError, match="must hold 12 elements"):
            quantized_all_gather(comm, torch.empty(11), torch.empty(3), quantizer)
        with pytest.raises(ValueError, match="input must be contiguous"):
            quantized_all_gather(comm, torch.empty(24), torch.empty(3, 2).t(), quantizer)

    run_simulated(4, body)


# ------------------------------------------------------------ gloo and MPI, same bits
def same_bits_body(comm: Communicator) -> dict[str, str]:
    """qwZ (int8, bfloat16) and qgZ (int4 float32, int8 bfloat16) on 2 nodes x 2 ranks;
    the sha256 of each output. Runs on real ranks and in the simulated world alike."""
    intra, inter = node_groups(comm, 2)
    size, digests = comm.world_size, {}
    shard = rank_input(11, comm.rank, 1001, torch.bfloat16)
    gathered = torch.empty(size * 1001, dtype=torch.bfloat16)
    quantized_all_gather(comm, gathered, shard, BlockQuantizer(8, 256), label="qwZ")
    digests["qwZ int8 bf16"] = _digest(gathered)
    for name, bits, dtype in [("int4 fp32", 4, torch.float32), ("int8 bf16", 8, torch.bfloat16)]:
        grads = rank_input(12 + bits, comm.rank, size * 777, dtype)
        output = torch.empty(777, dtype=dtype)
        quantized_reduce_scatter(intra, inter, output, grads, BlockQuantizer(bits, 128))
        digests[f"qgZ {name}"] = _digest(output)
    return digests


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()


def _has_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return find_mpiexec() is not None


def same_bits_on_mpi_and_gloo(comm: Communicator) -> dict[str, dict[str, str]]:
    """Under mpiexec: :func:`same_bits_body` on the MPI world given, and on a gloo world of
    the same processes (its rendezvous goes over mpi4py): one start of 4 ranks, not two."""
    gloo = zero_comm.init("gloo", timeout=60)
    try:
        return {"mpi": same_bits_body(comm), "gloo": same_bits_body(gloo)}
    finally:
        gloo.close()


@pytest.mark.gloo
@pytest.mark.mpi
@pytest.mark.skipif(not _has_mpi(), reason="no mpi4py/mpiexec: pip install mpich mpi4py")
def test_gloo_and_mpi_give_the_bits_of_the_simulated_world() -> None:
    """4 ranks as 2 nodes x 2 under mpiexec, each output's sha256 on the mpi backend and on
    gloo: both equal the simulated world's, so each other's (the harness checks that the
    ranks compute with this process's thread count)."""
    reports = run_on_ranks(same_bits_on_mpi_and_gloo, 4, backend="mpi", launcher="mpiexec")
    simulated = run_simulated(4, same_bits_body)
    assert [r["value"]["mpi"] for r in reports] == simulated, "MPI differs"
    assert [r["value"]["gloo"] for r in reports] == simulated, "gloo differs"
