"""Uneven shards are exact (issue 52, point 2): a run with ``shard_weights`` equals the
run without (same N, even shards) bit for bit after every step, at stages 1-3, with
accumulation, clipping, every dtype and offload tier the parity suite draws; and its
checkpoints load into even shards, another N and other weights, and back, exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    assert_same_states,
    build_engine,
    normalised,
    offloaded_parity_cases,
    parity_cases,
    train,
)
from test_checkpoint import logical_state, run_steps

from zero_comm import Communicator, run_simulated
from zero_core.checkpoint.format import INDEX, CheckpointError, index_checksum

WEIGHTS = st.sampled_from([1, 2, 3, 0.5, 7])


def weights_for(n: int) -> Any:
    """One drawn weight per rank, never all equal (an even split proves nothing new)."""
    return st.lists(WEIGHTS, min_size=n, max_size=n).filter(lambda w: len(set(w)) > 1 or n == 1)


def uneven_equals_even(comm: Communicator, case: ParityCase, weights: list[float]) -> None:
    """Stages 1-3 with ``weights`` equal the same stage with even shards, which the
    parity suite proves equal to stage 0; stage 0 itself is compared once more."""
    plain = ParityCase(**{**case.__dict__, "offload_optimizer": "none", "offload_params": "none"})
    reference = train(plain, comm, 0)
    for stage in (1, 2, 3):
        uneven = train(case, comm, stage, settings={"shard_weights": weights})
        assert_same_states(reference, uneven, f"stage {stage}, weights {weights}, {case}")


@st.composite
def worlds(draw: Any) -> tuple[int, list[float]]:
    n = draw(st.sampled_from([2, 2, 3, 4]))
    return n, draw(weights_for(n))


@settings(max_examples=12, deadline=None)
@given(case=parity_cases(), world=worlds())
def test_uneven_shards_equal_even_shards_bit_for_bit(
    case: ParityCase, world: tuple[int, list[float]]
) -> None:
    """Random models, dtypes, optimizers, accumulation, clipping, bucket sizes and
    coalescing settings (turned off by uneven shards), with drawn weights."""
    n, weights = world
    run_simulated(n, lambda comm: uneven_equals_even(comm, normalised(case), weights))


@settings(max_examples=8, deadline=None)
@given(case=offloaded_parity_cases(), world=worlds())
def test_uneven_shards_with_offload_tiers_equal_the_device_only_even_run(
    case: ParityCase, world: tuple[int, list[float]]
) -> None:
    """Masters and optimizer states on host or disk (parameters too at stage 3), any
    fraction and sub-group size: the uneven tiers equal stage 0 without offload."""
    n, weights = world
    run_simulated(n, lambda comm: uneven_equals_even(comm, case, weights))


CASE = normalised(
    ParityCase(
        widths=(5, 130, 7),
        vocab=11,
        tie=True,
        two_groups=True,
        optimizer="adamw",
        dtype="bfloat16",
        bucket_numel=300,
        persistence_threshold=0,
    )
)
# (world size, stage, shard_weights or None)
RUN = st.sampled_from([
    (2, 3, [2, 1]), (2, 2, [1, 3]), (3, 1, [3, 1, 2]), (3, 3, [1, 1, 5]),
    (2, 2, None), (3, 3, None), (1, 0, None), (4, 3, [2, 1, 1, 1]),
])  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(before=RUN, after=RUN)
def test_uneven_checkpoints_reshard_to_any_layout_and_back(
    before: tuple[int, int, list[float] | None],
    after: tuple[int, int, list[float] | None],
    tmp_path_factory: Any,
) -> None:
    """Saved with one layout (N, stage, weights), loaded with another: the logical state
    is bit-identical, it saves back the same, and training goes on exactly as stage 0
    loaded from the same file."""
    (n, s, w_before), (m, t, w_after) = before, after
    folder = tmp_path_factory.mktemp("uneven")

    def save_body(comm: Communicator) -> None:
        engine = build_engine(CASE, comm, s, {"shard_weights": w_before})
        run_steps(engine, CASE, comm, 0, 2)
        engine.save(folder / "first")

    def load_body(comm: Communicator) -> None:
        engine = build_engine(CASE, comm, t, {"shard_weights": w_after})
        engine.load(folder / "first")
        engine.save(folder / "again")
        run_steps(engine, CASE, comm, 2, 1)
        oracle = build_engine(CASE, comm, 0)
        oracle.load(folder / "first")
        run_steps(oracle, CASE, comm, 2, 1)
        state, expected = engine.full_state_dict(), oracle.full_state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)

    run_simulated(n, save_body)
    run_simulated(m, load_body)
    first, again = logical_state(folder / "first"), logical_state(folder / "again")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first), (before, after)


def _index(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / INDEX).read_text())  # type: ignore[no-any-return]


def _rewrite(folder: Path, index: dict[str, Any]) -> None:
    import json

    index.pop("index_crc32", None)
    index["index_crc32"] = index_checksum(index)
    (folder / INDEX).write_text(json.dumps(index))


def test_the_index_describes_the_layout_and_a_mismatched_one_is_named(tmp_path: Path) -> None:
    """The index records the weights and every rank's pieces; a layout whose pieces no
    longer cover a parameter, or weights that do not fit the saving ranks, are named."""

    def save_body(comm: Communicator) -> None:
        engine = build_engine(CASE, comm, 3, {"shard_weights": [2, 1]})
        run_steps(engine, CASE, comm, 0, 1)
        engine.save(tmp_path / "ckpt", tag="t")

    run_simulated(2, save_body)
    folder = tmp_path / "ckpt" / "t"
    index = _index(folder)
    assert index["shard_weights"] == [2.0, 1.0]
    sizes = [sum(stop - start for _, start, stop, _ in r["pieces"][0]) for r in index["ranks"]]
    assert sizes[0] > sizes[1]  # rank 0 saved the larger share

    def load_error() -> str:
        def body(comm: Communicator) -> None:
            build_engine(CASE, comm, 2).load(folder)

        with pytest.raises(Exception) as error:
            run_simulated(2, body)
        cause = error.value.__cause__ or error.value
        assert isinstance(cause, CheckpointError), cause
        return str(cause)

    broken = _index(folder)
    broken["ranks"][1]["pieces"][0] = broken["ranks"][1]["pieces"][0][1:]  # a piece lost
    _rewrite(folder, broken)
    assert "not covered exactly" in load_error()
    wrong = _index(folder)
    wrong["ranks"][1]["pieces"] = index["ranks"][1]["pieces"]
    wrong["shard_weights"] = [2, 1, 1]
    _rewrite(folder, wrong)
    assert "shard_weights" in load_error()


@pytest.mark.parametrize(
    ("stage", "setting"),
    [
        (3, {"optimizer_in_backward": True, "nonfinite": "raise"}),
        (2, {"offload_optimizer": "cpu", "delayed_parameter_update": True}),
        (3, {"reduce_dtype": "float32"}),
    ],
)
def test_fused_and_delayed_steps_with_uneven_shards_equal_even_shards(
    stage: int, setting: dict[str, Any]
) -> None:
    """The step in backward (each bucket's slice stepped as it lands), ZeRO-Offload's
    delayed update and float32 reductions with clipping, with weights 2, 1, 1: the same
    bits as the same settings with even shards."""

    clip = None if "optimizer_in_backward" in setting else 0.05
    case = ParityCase(**{**CASE.__dict__, "clip": clip})

    def body(comm: Communicator) -> None:
        even = train(case, comm, stage, settings=setting)
        uneven = train(case, comm, stage, settings={**setting, "shard_weights": [2, 1, 1]})
        assert_same_states(even, uneven, f"stage {stage}, {setting}")

    run_simulated(3, body)
