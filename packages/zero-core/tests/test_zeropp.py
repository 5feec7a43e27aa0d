"""ZeRO++'s lossy parts in the engine (qwZ, qgZ): deterministic, active, and never a
silent fallback. The per-collective error bounds are zero_comm's test_quantized; the
convergence of the default GPT is zero_models' (nox -s slow)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from parity import ParityCase, assert_same_states, build_engine, train

from zero_comm import Communicator, QuantizationFallbackWarning, Topology, run_simulated

CASE = ParityCase(widths=(40, 96, 33), dtype="bfloat16", optimizer="adam", steps=3,
                  bucket_numel=4000, persistence_threshold=0)  # fmt: skip
QWZ = {"quantize_weights": True}
QGZ4 = {"quantize_gradients": "int4"}
QGZ8 = {"quantize_gradients": "int8"}


def runs(settings: dict[str, Any], n: int = 4, per_node: int = 2) -> list[dict[str, Any]]:
    return run_simulated(
        n, lambda comm: train(CASE, comm, 3, settings=settings), ranks_per_node=per_node
    )[0]


@pytest.mark.parametrize("settings", [QWZ, QGZ4, QGZ8], ids=["qwZ", "qgZ-int4", "qgZ-int8"])
def test_a_quantized_run_repeats_bit_for_bit_and_is_not_the_exact_one(
    settings: dict[str, Any],
) -> None:
    first, again, exact = runs(settings), runs(settings), runs({})
    assert_same_states(first, again, f"{settings} twice")
    last = len(exact) - 1
    assert any(not torch.equal(first[last][k], exact[last][k]) for k in exact[last])
    for key, value in exact[last].items():  # lossy, but near: a few quantization steps
        assert torch.allclose(first[last][key], value, rtol=0.1, atol=0.05), key


def test_hpz_on_qwz_is_lossless_backward_computes_with_forwards_bits() -> None:
    """qwZ's backward gather decodes the same shard to the same bits; hpZ's copies the
    forward's: the two runs are identical."""
    assert_same_states(runs(QWZ), runs({**QWZ, "hpz_partition_size": 2}), "qwZ vs qwZ + hpZ")


def uneven(comm: Communicator) -> None:
    comm.set_topology(Topology((0, 0, 0, 0, 1, 1)))


def test_qgz_on_unequal_nodes_is_an_error_unless_a_fallback_is_allowed() -> None:
    def refused(comm: Communicator) -> None:
        uneven(comm)
        with pytest.raises(ValueError, match="allow_quantize_fallback=True"):
            build_engine(CASE, comm, 2, QGZ4)

    run_simulated(6, refused)

    def allowed(comm: Communicator) -> list[dict[str, torch.Tensor]]:
        uneven(comm)
        return train(CASE, comm, 2, settings={**QGZ4, "allow_quantize_fallback": True})

    def exact(comm: Communicator) -> list[dict[str, torch.Tensor]]:
        uneven(comm)
        return train(CASE, comm, 2)

    with warnings.catch_warnings(record=True) as caught:  # warnings are per process
        warnings.simplefilter("always")
        fallen_back = run_simulated(6, allowed)[0]
    assert caught and {w.category for w in caught} == {QuantizationFallbackWarning}
    assert_same_states(run_simulated(6, exact)[0], fallen_back, "fallback")


def test_qgz_and_hybrid_sharding_together_are_refused() -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="use one of them"):
            build_engine(CASE, comm, 3, {**QGZ4, "shard_group_size": 2})

    run_simulated(4, body, ranks_per_node=2)
