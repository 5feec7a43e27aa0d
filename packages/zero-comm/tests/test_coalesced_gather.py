"""all_gather_coalesced (coalesced_gather.py): one collective for several all-gathers,
each output the bits of its own all-gather (plain, or qwZ's quantized one)."""

from __future__ import annotations

import warnings

import pytest
import torch
from codec_cases import DTYPES, quantizers, rank_input
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import (
    Communicator,
    QuantizationFallbackWarning,
    all_gather_coalesced,
    quantized_all_gather,
    run_simulated,
)
from zero_comm import quantized as quantized_module
from zero_comm.block_quantize import BlockQuantizer

Gathered = tuple[list[torch.Tensor], list[torch.Tensor], int, int, int, int]


@settings(max_examples=30, deadline=None)
@given(
    world_size=st.integers(1, 4),
    numels=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    quantizer=st.none() | quantizers(),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_each_output_is_what_its_own_all_gather_gives_with_the_same_bytes(
    world_size: int,
    numels: list[int],
    quantizer: BlockQuantizer | None,
    dtype: str,
    seed: int,
) -> None:
    torch_dtype = DTYPES[dtype]

    def body(comm: Communicator) -> Gathered:
        inputs = [
            rank_input(seed + k, comm.rank, numel, torch_dtype) for k, numel in enumerate(numels)
        ]

        def blank() -> list[torch.Tensor]:
            return [torch.full((world_size * n,), float("nan"), dtype=torch_dtype) for n in numels]

        coalesced, alone = blank(), blank()
        comm.stats.reset()
        handle = all_gather_coalesced(comm, coalesced, inputs, quantizer, label="units")
        handle.wait()
        handle.wait()  # harmless
        calls, volume = comm.stats["all_gather"].calls, comm.stats["all_gather"].volume_bytes
        comm.stats.reset()
        for output, shard in zip(alone, inputs, strict=True):
            if quantizer is None:
                comm.all_gather(output, shard, label="unit")
            else:
                quantized_all_gather(comm, output, shard, quantizer, label="unit")
        alone_calls = comm.stats["all_gather"].calls
        return coalesced, alone, calls, volume, alone_calls, comm.stats["all_gather"].volume_bytes

    for coalesced, alone, calls, volume, alone_calls, alone_volume in run_simulated(
        world_size, body
    ):
        for got, expected in zip(coalesced, alone, strict=True):
            # NaN is a legal input value (rank_input draws none, but be exact either way)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        assert calls == (1 if world_size > 1 else 0)  # one collective, none on one rank
        # one per input, but qwZ on one rank makes none
        assert alone_calls == (0 if world_size == 1 and quantizer else len(numels))
        assert volume == alone_volume


def test_bad_arguments_are_errors_that_say_what_to_pass() -> None:
    def body(comm: Communicator) -> None:
        shard = torch.ones(3)
        with pytest.raises(ValueError, match="one output per input"):
            all_gather_coalesced(comm, [torch.empty(6)], [shard, shard])
        with pytest.raises(ValueError, match="must hold 6 elements"):
            all_gather_coalesced(comm, [torch.empty(5)], [shard])
        with pytest.raises(TypeError, match="share one dtype"):
            all_gather_coalesced(
                comm,
                [torch.empty(6), torch.empty(6, dtype=torch.float64)],
                [shard, shard.double()],
            )
        with pytest.raises(ValueError, match="allow_fallback=True"):
            all_gather_coalesced(
                comm, [torch.empty(6, dtype=torch.float64)], [shard.double()], BlockQuantizer(8, 16)
            )

    run_simulated(2, body)


def tensors_held_by(root: object, depth: int = 5) -> list[torch.Tensor]:
    """The tensors reachable from ``root`` through attributes, closures and containers."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(value: object, left: int) -> None:
        if id(value) in seen or left < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
            return
        if isinstance(value, (list, tuple, set)):
            children: list[object] = list(value)
        elif isinstance(value, dict):
            children = list(value.values())
        elif callable(value) and getattr(value, "__closure__", None):
            children = [cell.cell_contents for cell in value.__closure__]  # type: ignore[attr-defined]
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            children = list(vars(value).values())
        else:
            return
        for child in children:
            visit(child, left - 1)

    visit(root, depth)
    return found


def test_the_outputs_are_written_at_the_wait_and_the_received_buffer_dropped_there() -> None:
    """Until the wait the outputs are as they were; after it, the handle (which every unit
    of a coalesced run keeps until its own wait) holds no buffer any more."""

    def body(comm: Communicator) -> None:
        inputs = [torch.full((3,), float(comm.rank)), torch.full((5,), 10.0 + comm.rank)]
        outputs = [torch.full((6,), float("nan")), torch.full((10,), float("nan"))]
        for quantizer in (None, BlockQuantizer(8, 4)):
            handle = all_gather_coalesced(comm, outputs, inputs, quantizer)
            assert all(output.isnan().all() for output in outputs)
            held = tensors_held_by(handle)  # the received buffer: 2 x 8 elements, or their code
            assert any(t.numel() >= 16 for t in held), "no received buffer before the wait"
            handle.wait()
            assert torch.equal(outputs[0], torch.tensor([0.0] * 3 + [1.0] * 3))
            assert tensors_held_by(handle) == []
            for output in outputs:
                output.fill_(float("nan"))

    run_simulated(2, body)


def test_an_unquantizable_dtype_falls_back_to_the_plain_bits_with_one_warning() -> None:
    """One warning for the dtype, whether its shards went coalesced or alone."""

    def body(comm: Communicator) -> list[torch.Tensor]:
        inputs = [
            torch.arange(3, dtype=torch.float64) + comm.rank,
            torch.ones(2, dtype=torch.float64),
        ]
        outputs = [torch.empty(6, dtype=torch.float64), torch.empty(4, dtype=torch.float64)]
        all_gather_coalesced(
            comm, outputs, inputs, BlockQuantizer(8, 4), allow_fallback=True
        ).wait()
        # A unit gathered alone, as stage 3 does beside coalesced runs: the same fallback,
        # so no second warning.
        alone = torch.empty(4, dtype=torch.float64)
        quantized_all_gather(comm, alone, inputs[1], BlockQuantizer(8, 4), allow_fallback=True)
        return [*outputs, alone]

    quantized_module._WARNED.clear()  # once per reason per process: forget earlier tests'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = run_simulated(2, body)[0]
    assert torch.equal(outputs[0], torch.tensor([0.0, 1, 2, 1, 2, 3], dtype=torch.float64))
    assert torch.equal(outputs[1], torch.ones(4, dtype=torch.float64))
    assert torch.equal(outputs[2], torch.ones(4, dtype=torch.float64))
    fallbacks = [w for w in caught if issubclass(w.category, QuantizationFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]  # the ranks share a process
