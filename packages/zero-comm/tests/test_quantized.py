"""ZeRO++'s collectives qwZ and qgZ (quantized.py); the codec itself is test_block_quantize.py.

Tolerances: the codec's are in codec_cases.py; qgZ's bound is derived in ``qgz_bound``.
Where the result is defined bit for bit (a part of the gather is the codec's round trip of
that shard; qgZ is a fixed sequence of codec round trips and float32 additions), the
assertion is ``torch.equal``.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import deque
from fractions import Fraction
from typing import Any

import pytest
import torch
from codec_cases import (
    DTYPES,
    U,
    block_absmax,
    cast_slack,
    codec_slack,
    quantizers,
    rank_input,
    scale_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import zero_comm
from zero_comm import Communicator, run_simulated
from zero_comm import quantized as quantized_module
from zero_comm.block_quantize import BlockQuantizer
from zero_comm.quantized import (
    QuantizationFallbackWarning,
    QuantizedHandle,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from zero_comm.simulated import SimulatedRankError
from zero_comm.testing import find_mpiexec, run_on_ranks


def node_groups(comm: Communicator, per_node: int) -> tuple[Communicator, Communicator]:
    """(intra, inter) for node-major ranks: node = rank // per_node."""
    intra = comm.split(color=comm.rank // per_node)
    inter = comm.split(color=comm.rank % per_node)
    return intra, inter


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


def launch_qgz(
    comm: Communicator,
    intra: Communicator,
    inter: Communicator,
    output: torch.Tensor,
    input: torch.Tensor,
    quantizer: BlockQuantizer,
    index: int,
) -> QuantizedHandle:
    """Launch number ``index`` of a rank's asynchronous qgZ reductions, labelled by its
    index so that the consistency check compares every launch's order across ranks."""
    return quantized_reduce_scatter(
        intra, inter, output, input, quantizer, world=comm, async_op=True, label=f"g{index}"
    )


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
            launch_qgz(comm, intra, inter, outputs[k], inputs[comm.rank][k], quantizer, k)
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


def test_issuing_a_qgz_reduction_sends_the_one_before_it_across_nodes() -> None:
    """The inter-node stage of a launched reduction is issued when the next one is
    launched, not at its wait: it travels while the caller fills the next bucket. Waiting
    then completes both in issue order, with the documented sums."""
    nodes, per_node, chunk, quantizer = 2, 2, 32, BlockQuantizer(4, 8)
    size = nodes * per_node
    inputs = [[rank_input(k, r, size * chunk, torch.float32) for k in range(2)] for r in range(4)]

    def body(comm: Communicator) -> tuple[list[int], list[torch.Tensor]]:
        intra, inter = node_groups(comm, per_node)
        outputs = [torch.empty(chunk) for _ in range(2)]
        across = []
        handles = []
        for k in range(2):
            handles.append(
                launch_qgz(comm, intra, inter, outputs[k], inputs[comm.rank][k], quantizer, k)
            )
            across.append(inter.stats["all_to_all"].calls)
        handles[1].wait()
        across.append(inter.stats["all_to_all"].calls)
        assert handles[0].is_completed()
        return across, outputs

    for rank, (across, outputs) in enumerate(run_simulated(size, body, defer_outputs=True)):
        assert across == [0, 1, 2], f"rank {rank}: inter-node all-to-alls issued {across}"
        for k, output in enumerate(outputs):
            expected = reference_qgz([inputs[r][k] for r in range(size)], quantizer, nodes,
                                     per_node, rank)  # fmt: skip
            assert torch.equal(output, expected)


def test_handles_advance_in_issue_order_and_a_failed_advance_stays_failed() -> None:
    """Issuing a handle advances every earlier one of its order, oldest first, once; an
    advance that raises fails its handle (the error reaches the issuer), and the handles
    issued after it, the issuer's own included, still advance and complete."""
    log: list[str] = []
    order: deque[QuantizedHandle] = deque()

    def step(name: str) -> Any:
        return lambda: log.append(name)

    def fails() -> None:
        raise MemoryError("encode")

    first = QuantizedHandle(None, step("finish 1"), order, step("advance 1"))
    assert log == []
    second = QuantizedHandle(None, step("finish 2"), order, fails)
    assert log == ["advance 1"]
    with pytest.raises(MemoryError):
        QuantizedHandle(None, step("finish 3"), order, step("advance 3"))
    assert log == ["advance 1"]
    with pytest.raises(RuntimeError, match=r"failed before .*MemoryError: encode"):
        second.wait()
    first.wait()
    assert log == ["advance 1", "finish 1"] and first.is_completed()
    fourth = QuantizedHandle(None, step("finish 4"), order, step("advance 4"))
    fourth.wait()  # the third, whose issue raised, still completes in its turn
    assert log[2:] == ["advance 3", "finish 3", "advance 4", "finish 4"] and not order


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
