"""The memory formulas against the paper's Figure 1, and their structure as properties."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_core import model_state_bytes
from zero_core.activation_estimate import (
    TransformerShape,
    activation_bytes,
    paper_activation_elements,
)
from zero_core.estimate_cli import main


def test_paper_figure_1() -> None:
    """Ψ = 7.5e9, N = 64, K = 12: 120, 31.4, 16.6, 1.9 GB, rounded as the paper does."""
    totals = [round(model_state_bytes(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]
    assert totals == [120.0, 31.4, 16.6, 1.9]


@given(st.integers(0, 10**12), st.integers(1, 4096), st.floats(0, 32))
def test_stages_never_hold_more_and_agree_at_one_rank(params: int, n: int, k: float) -> None:
    totals = [model_state_bytes(params, n, s, optimizer_state_bytes=k).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    single = [model_state_bytes(params, 1, s, optimizer_state_bytes=k).total for s in range(4)]
    assert single == [single[0]] * 4
    # (2 + 2 + K) Ψ summed term by term may round differently from (4 + K) * Ψ.
    assert single[0] == pytest.approx((4 + k) * params, rel=1e-12)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stage": 4}, "stage"), ({"world_size": 0}, "world_size"), ({"params": -1}, "params"),
])  # fmt: skip
def test_bad_input_is_named(kwargs: dict[str, int], message: str) -> None:
    args = {"params": 10, "world_size": 2, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        model_state_bytes(args["params"], args["world_size"], args["stage"])


def test_cli_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.estimate_cli", "--params", "7.5e9",
         "--world-size", "64", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert round(json.loads(out)["2"]["total"] / 1e9, 1) == 16.6


def test_cli_dtype_and_optimizer_set_the_bytes_per_parameter() -> None:
    """fp32 SGD with momentum: 4 + 4 bytes of parameters and gradients, K = 4 (the
    momentum; fp32 parameters are their own master weights at every stage)."""
    out = subprocess.run(
        [sys.executable, "-m", "zero_core.estimate_cli", "--params", "1000", "--world-size",
         "4", "--dtype", "fp32", "--optimizer", "sgd-momentum", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    totals = {stage: row["total"] for stage, row in json.loads(out).items()}
    assert totals == {"0": 12000, "1": 8000 + 1000, "2": 4000 + 2000, "3": 3000}


def test_activation_estimate_checkpoints_and_partitions() -> None:
    """Without checkpointing a block keeps n (4C + 12C/p) elements plus n (4 + H/p) float32
    statistics; checkpointing keeps n C, P_a n C / p; the paper's rule is 12 n C L."""
    shape = TransformerShape(layers=12, width=768, heads=12, vocab_size=50257, tokens=1024)
    none = activation_bytes(shape, checkpoint="none", dtype_bytes=2)
    full = activation_bytes(shape, checkpoint="full", dtype_bytes=2)
    p_a = activation_bytes(shape, tp=4, checkpoint="partitioned", dtype_bytes=2)
    assert none.kept == 12 * 1024 * (16 * 768 * 2 + (4 + 12) * 4)
    assert full.kept == 12 * 1024 * 768 * 2
    assert p_a.kept == full.kept / 4
    assert paper_activation_elements(shape) == 12 * 768 * 1024 * 12
    assert none.peak > none.kept and full.peak < none.peak and p_a.peak < full.peak
    with pytest.raises(ValueError, match="checkpoint mode"):
        activation_bytes(shape, checkpoint="some")  # type: ignore[arg-type]


def test_zero_estimate_adds_activations_to_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--params", "124e6", "--world-size", "4", "--layers", "12", "--width", "768",
          "--heads", "12", "--vocab-size", "50257", "--tokens", "1024", "--json"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    for row in rows.values():
        assert row["step_peak"] == row["total"] + row["activations_peak"] > row["total"]
    with pytest.raises(SystemExit):
        main(["--params", "1e6", "--world-size", "2", "--layers", "3"])
    assert "give all of --layers" in capsys.readouterr().err
