"""The engine's offload copies through copy_streams: host master tiles go up to the device
parameters on a side stream, and the current stream waits for them (an event) before a
gather or the next forward reads them; the bits equal stage 0 without offload.

On CPU the CopyStream copies inline; here the parameters' CopyStream is replaced by one
driven by test_copy_streams.RecordingStreams (the staging ring in tiny slots, every stream
and event call logged), so the ordering the CUDA path relies on is checked on CPU.
"""

from __future__ import annotations

import pytest
from parity import ParityCase, assert_same_states, build_engine, normalised, run_steps, train
from test_copy_streams import RecordingStreams

from zero_comm import Communicator, run_simulated
from zero_core.offload.copy_streams import CopyStream

CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                  dtype="bfloat16", bucket_numel=300, sub_group_numel=64, steps=3)  # fmt: skip


def uploads_of(engine: object, stage: int) -> object:
    """The component whose uploads are replaced: the parameters (stages 0-2) or stage 3's
    device-tier shard store."""
    parameters = engine.compute_params  # type: ignore[attr-defined]
    return parameters.store if stage == 3 else parameters


def check_every_upload_is_waited_for(log: list[str]) -> int:
    """Between two step ends, the last upload event recorded is waited for by the current
    stream after it was recorded; returns how many upload pieces there were."""
    pieces, segment = 0, []
    for entry in log:
        if entry != "step end":
            segment.append(entry)
            continue
        recorded = [i for i, e in enumerate(segment) if e.startswith("record side")]
        pieces += len(recorded)
        if recorded:
            last = segment[recorded[-1]].removeprefix("record ")
            waits = [i for i, e in enumerate(segment) if e == f"current waits {last}"]
            assert waits and waits[-1] > recorded[-1], f"upload {last} not waited for: {segment}"
        segment = []
    return pieces


@pytest.mark.parametrize(
    ("stage", "optimizer", "world_size"),
    [(2, "cpu", 1), (2, "disk", 2), (1, "cpu", 2), (3, "cpu", 2), (3, "disk", 1)],
)
def test_host_tiles_go_up_on_the_side_stream_and_are_waited_for(
    stage: int, optimizer: str, world_size: int
) -> None:
    case = normalised(ParityCase(**{**CASE.__dict__, "offload_optimizer": optimizer}))
    plain = ParityCase(**{**case.__dict__, "offload_optimizer": "none"})

    def body(comm: Communicator) -> None:
        reference = train(plain, comm, 0)
        engine = build_engine(case, comm, stage)
        streams = RecordingStreams()
        target = uploads_of(engine, stage)
        target._copies = CopyStream(comm.device, slots=2, slot_bytes=64, streams=streams)  # type: ignore[attr-defined]
        original = engine.step

        def step() -> bool:
            applied = original()
            streams.log.append("step end")
            return applied

        engine.step = step  # type: ignore[method-assign]
        states = run_steps(engine, case, comm, range(case.steps))
        engine.close()
        assert_same_states(reference, states, f"stage {stage}, offload {optimizer}")
        pieces = check_every_upload_is_waited_for(streams.log)
        assert pieces > 2 * case.steps  # tiles of more than 64 bytes: several pieces each
        assert streams.staged == 2  # the ring, never more

    run_simulated(world_size, body)
