"""A sharded gradient has storage only from backward to the step (issue 17): each bucket
slice of the shard gets its storage when its first reduced slice lands and loses it after
the step, as FSDP2's zero_grad(set_to_none=True) does, so the forward pass and the
activations of the layers backward has not reached yet are not held beside a whole
gradient shard. Results stay equal to stage 0 (the parity suites, and the last test)."""

from __future__ import annotations

import pytest
import torch
from parity import ParityCase, build_engine, loss_of, micro_batch

from zero_comm import Communicator, run_simulated
from zero_core.component_access import reduce_scattered_gradients
from zero_core.engine import Engine
from zero_core.reduced_gradient import ShardGradient

# One Linear(64, 64) per bucket: 64 * 64 + 64 elements fit 4160.
CASE = ParityCase(widths=(64,) * 7, bucket_numel=4160, persistence_threshold=0)


def held_bytes(engine: Engine) -> int:
    shards = reduce_scattered_gradients(engine).grad_shards
    return sum(shard.held_bytes() for shard in shards)


def storage_by_phase(comm: Communicator, stage: int, accumulation: int) -> dict[str, list[int]]:
    case = ParityCase(**{**CASE.__dict__, "accumulation": accumulation})
    engine = build_engine(case, comm, stage)
    whole = sum(s.nbytes() for s in reduce_scattered_gradients(engine).grad_shards)
    seen: dict[str, list[int]] = {"whole": [whole], "in backward": []}

    def in_backward(slot: object) -> None:
        seen["in backward"].append(held_bytes(engine))

    reduce_scattered_gradients(engine).gradient_listeners.append(in_backward)
    for step in range(2):
        for micro in range(accumulation):
            x, target = micro_batch(case, (step * accumulation + micro) * 2 + comm.rank)
            loss = loss_of(case, engine(x), target)
            seen.setdefault("after forward", []).append(held_bytes(engine))
            engine.backward(loss)
            seen.setdefault("after backward", []).append(held_bytes(engine))
            seen.setdefault("report", []).append(engine.memory_report().gradients)
            engine.step()
        seen.setdefault("after step", []).append(held_bytes(engine))
    return seen


@pytest.mark.parametrize(("stage", "accumulation"), [(2, 1), (3, 1), (2, 2), (3, 2), (1, 2)])
def test_gradient_shards_hold_storage_only_from_backward_to_step(
    stage: int, accumulation: int
) -> None:
    for seen in run_simulated(2, lambda comm: storage_by_phase(comm, stage, accumulation)):
        whole = seen["whole"][0]
        assert whole > 0
        # the first forward of every step holds none; later micro-steps accumulate into it
        assert seen["after forward"][::accumulation] == [0, 0]
        assert seen["after step"] == [0, 0]
        assert seen["after backward"] == [whole] * (2 * accumulation)
        # memory_report counts what the step holds, whether held right now or not (stage 1
        # holds its full gradient buffers as well)
        full = seen["report"][0] - whole
        assert seen["report"] == [whole + full] * (2 * accumulation)
        assert full == 0 if stage > 1 else full > 0
        inside = seen["in backward"]
        # bucket by bucket: the first hook of a step sees none, later ones a growing part
        assert inside[0] == 0
        assert 0 < max(inside) <= whole
        assert len(set(inside)) > 2, "storage came bucket by bucket, not all at once"


def test_a_range_across_two_bucket_slices_is_refused() -> None:
    shard = ShardGradient.unallocated([4, 6], [0, 4], torch.float32, "cpu")
    shard.materialize_zeros()
    assert shard[4:10].numel() == 6
    with pytest.raises(ValueError, match="cross a bucket boundary"):
        shard[2:6]


def test_released_gradient_shards_still_equal_stage_0() -> None:
    """Three steps with accumulation of stage 2 and 3 equal stage 0 bit for bit, with the
    shards freed after every step and given storage again by the next backward."""
    case = ParityCase(**{**CASE.__dict__, "accumulation": 2, "clip": 0.5})

    def train(comm: Communicator, stage: int) -> dict[str, torch.Tensor]:
        engine = build_engine(case, comm, stage)
        for step in range(3):
            for micro in range(2):
                x, target = micro_batch(case, (step * 2 + micro) * 2 + comm.rank)
                engine.backward(loss_of(case, engine(x), target))
                engine.step()
        return engine.full_state_dict()

    stage0 = run_simulated(2, lambda comm: train(comm, 0))[0]
    for stage in (2, 3):
        other = run_simulated(2, lambda comm, stage=stage: train(comm, stage))[0]
        for key, value in stage0.items():
            assert torch.equal(value, other[key]), (stage, key)
