"""Checkpoints across versions and precisions: a checkpoint written before the engine was
restructured still loads (fixtures/checkpoint_v1), and the loss scaler's state crosses
between float16 and bfloat16 runs without turning dynamic scaling off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import ParityCase, build_engine, normalised
from test_checkpoint import logical_state, run_steps

from zero_comm import Communicator, run_simulated

FIXTURES = Path(__file__).resolve().parent / "fixtures"
V1 = FIXTURES / "checkpoint_v1"
V1_CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                     dtype="float16", bucket_numel=300, persistence_threshold=0)  # fmt: skip
V1_STEPS = 3


# The fixture was saved under one fingerprint (AMD EPYC, AVX2, MKL, 1 thread); under
# any other, loading it warns.
pytestmark = pytest.mark.filterwarnings("ignore::zero_core.DeterminismWarning")


@pytest.mark.parametrize(("world_size", "stage"), [(2, 2), (1, 0), (3, 3), (2, 1)])
def test_a_version_1_checkpoint_loads_at_any_world_size_and_stage(
    world_size: int, stage: int, tmp_path: Path
) -> None:
    """Weights, optimizer states, counters and the float16 loss scale all come back: saved
    again by today's engine, the checkpoint's logical contents are the fixture's."""
    expected = torch.load(FIXTURES / "checkpoint_v1_expected.pt")
    case = normalised(V1_CASE)

    def body(comm: Communicator) -> dict[str, torch.Tensor]:
        engine = build_engine(case, comm, stage)
        assert engine.load(V1) == {"next_step": V1_STEPS}
        assert engine.global_steps == V1_STEPS
        assert engine.loss_scaler.dynamic
        assert engine.loss_scaler.state_dict() == {
            "scale": expected["loss_scale"]["scale"], "good_steps": V1_STEPS, "overflows_left": 2
        }  # fmt: skip
        state = engine.full_state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected["saved"].items())
        engine.save(tmp_path / "again")
        if world_size == 2:  # the fixture's micro-batches: the next step is the fixture's
            run_steps(engine, case, comm, V1_STEPS, 1)
            return engine.full_state_dict()
        return {}

    after = run_simulated(world_size, body)[0]
    assert logical_state(tmp_path / "again").keys() == logical_state(V1).keys()
    for key, value in logical_state(V1).items():
        assert torch.equal(logical_state(tmp_path / "again")[key], value), key
    if after:
        same_machine = _saved_fingerprint_is_this_one()
        for key, value in expected["next"].items():
            # Bits hold under the fingerprint the fixture was made with; elsewhere the one
            # step of float16 compute may round differently.
            if same_machine:
                assert torch.equal(after[key], value), key
            else:
                torch.testing.assert_close(after[key], value, rtol=1e-3, atol=1e-4)


def _saved_fingerprint_is_this_one() -> bool:
    import json

    from zero_comm.determinism import current_fingerprint, fingerprint_differences

    saved = json.loads((V1 / "index.json").read_text())["fingerprint"]
    mine = current_fingerprint(torch.device("cpu"))
    return not fingerprint_differences(saved, mine)


@pytest.mark.parametrize(("saved", "loaded"), [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_the_loss_scale_crosses_precisions(saved: str, loaded: str, tmp_path: Path) -> None:
    """bfloat16 -> float16: the float16 engine keeps its configured dynamic scale (and
    backs it off on an overflow); float16 -> bfloat16: the scale stays 1."""
    cases = {d: normalised(ParityCase(widths=(5, 7, 3), optimizer="adam", dtype=d))
             for d in (saved, loaded)}  # fmt: skip

    def body(comm: Communicator) -> tuple[bool, float, float]:
        first = build_engine(cases[saved], comm, 2)
        run_steps(first, cases[saved], comm, 0, 2)
        first.save(tmp_path / "ckpt")
        engine = build_engine(cases[loaded], comm, 2)
        engine.load(tmp_path / "ckpt")
        dynamic, scale = engine.loss_scaler.dynamic, engine.loss_scaler.scale
        for _ in range(2):  # hysteresis 2: the second overflow halves the scale
            x = torch.full((2, 5), 6e4, dtype=engine.dtype)
            engine.backward(engine(x).float().square().sum())
            engine.step()
        return dynamic, scale, engine.loss_scaler.scale

    dynamic, scale, after_overflows = run_simulated(2, body)[0]
    if loaded == "float16":
        assert dynamic and scale == 2.0**16 and after_overflows == 2.0**15
    else:
        assert not dynamic and scale == after_overflows == 1.0


def test_a_checkpoint_from_before_header_checksums_loads_with_one_note(tmp_path: Path) -> None:
    """The version 1 fixture has no header checksums: it loads, and rank 0 alone says once
    that its headers are read unchecked; a checkpoint saved now records them and loads
    without the note."""
    import warnings

    from zero_core.checkpoint.reader import CheckpointReader

    case = normalised(V1_CASE)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        engine.load(V1)
        engine.save(tmp_path / "now")
        engine.load(tmp_path / "now")

    with warnings.catch_warnings(record=True) as caught:  # the ranks are threads: one record
        warnings.simplefilter("always")
        run_simulated(2, body)
    notes = [str(w.message) for w in caught if "read unchecked" in str(w.message)]
    assert notes == [f"checkpoint {V1} was saved before its files' headers were checksummed: "
                     "they are read unchecked (a save now records them)"]  # fmt: skip
    assert CheckpointReader(tmp_path / "now").headers_unchecked == ""
