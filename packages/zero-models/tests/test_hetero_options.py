"""zero-train's mixed-hardware pieces that need no ranks: the options and their checks,
the sampler's virtual ranks, the slot padding and the choice 'auto' makes from profiles."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_models.data import BatchSampler
from zero_models.hetero_emulation import SlotPadding
from zero_models.hetero_options import (
    auto_virtual_ranks,
    counts_option,
    seconds_option,
    weights_option,
)
from zero_models.hetero_profile import (
    RankProfile,
    choose,
    describe,
    prediction_check,
    step_overhead,
)
from zero_models.train_options import parse_options


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro-batches-per-rank", "2,0"], "every rank runs at least one micro-batch"),
        (["--micro-batches-per-rank", "2,x"], "give whole numbers of micro-batches per rank"),
        (["--micro-batches-per-rank", "2,,1"], "give comma-separated numbers"),
        (["--micro-batches-per-rank", "2,1,1"], "3 values for 2 data-parallel ranks"),
        (["--shard-weights", "1,-1"], "every value must be > 0"),
        (["--shard-weights", "1"], "1 values for 2 data-parallel ranks; give one per rank"),
        (["--emulate-micro-batch-seconds", "0.1"], "1 values for 2 data-parallel ranks"),
        (["--emulate-micro-batch-seconds", "0,0.1"], "every value must be > 0"),
        (
            ["--micro-batches-per-rank", "2,1", "--batch-size", "16"],
            "--batch-size 16 does not split over 3 virtual ranks (micro-batches); use a "
            "multiple of 3 (e.g. --batch-size 18)",
        ),
        (
            ["--micro-batches-per-rank", "auto", "--virtual-ranks", "5", "--batch-size", "16"],
            "does not split over 5 virtual ranks",
        ),
        (["--micro-batches-per-rank", "auto", "--virtual-ranks", "1"], "give at least 2"),
        (["--virtual-ranks", "4"], "--virtual-ranks is for --micro-batches-per-rank auto"),
        (
            ["--micro-batches-per-rank", "1,1", "--nproc", "4", "--tp", "2", "--model", "test"],
            "mixed hardware is for data parallelism alone",
        ),
    ],
)
def test_wrong_options_stop_with_the_fix(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        parse_options(["--out", str(tmp_path / "out"), *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_lists_and_auto_parse() -> None:
    assert counts_option("2, 1") == (2, 1)
    assert counts_option("AUTO") == "auto"
    assert weights_option("2,1") == (2.0, 1.0)
    assert weights_option("auto") == "auto"
    assert seconds_option("0.2,0.4") == (0.2, 0.4)
    with pytest.raises(argparse.ArgumentTypeError):
        seconds_option("auto")


def test_autos_default_virtual_ranks_divide_the_batch() -> None:
    assert auto_virtual_ranks(16, 2) == 8
    assert auto_virtual_ranks(18, 2) == 6
    assert auto_virtual_ranks(12, 3) == 12
    assert auto_virtual_ranks(9, 2) == 3
    assert auto_virtual_ranks(11, 2) == 2  # none divides: each rank one slot (then refused)


def test_a_json_config_takes_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"micro_batches_per_rank": [2, 1], "batch_size": 16}))
    with pytest.raises(SystemExit):  # the list reached the option: 16 does not split over 3
        parse_options(["--config", str(config), "--out", str(tmp_path / "out")])
    assert "does not split over 3 virtual ranks" in capsys.readouterr().err
    config.write_text(json.dumps({"micro_batches_per_rank": [2, "x"]}))
    with pytest.raises(SystemExit):
        parse_options(["--config", str(config), "--out", str(tmp_path / "out")])
    assert "must be a list of numbers, one per rank" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(0, 5),
    st.integers(0, 2),
)
def test_each_slot_reads_its_virtual_ranks_rows(
    counts: list[int], per_slot: int, step: int, micro: int
) -> None:
    """Rank i's slot s reads what rank o_i + s of a homogeneous run at V ranks reads."""
    tokens = torch.arange(4000, dtype=torch.int32) % 251
    virtual = sum(counts)
    common = {"context": 8, "global_batch": per_slot * virtual, "seed": 3}
    homogeneous = [
        BatchSampler(tokens, dp_rank=v, dp_size=virtual, **common).batch(step, micro)
        for v in range(virtual)
    ]
    v = 0
    for rank, count in enumerate(counts):
        sampler = BatchSampler(tokens, dp_rank=rank, dp_size=len(counts), counts=counts, **common)
        assert sampler.slots == count
        for slot in range(count):
            got, want = sampler.batch(step, micro, slot), homogeneous[v]
            assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)
            v += 1


def test_a_sampler_refuses_a_batch_that_does_not_split_over_virtual_ranks() -> None:
    tokens = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not split over 3 virtual ranks"):
        BatchSampler(tokens, context=4, global_batch=4, dp_rank=0, dp_size=2, counts=(2, 1))
    with pytest.raises(ValueError, match="one count >= 1 for each of the 2"):
        BatchSampler(tokens, context=4, global_batch=4, dp_rank=0, dp_size=2, counts=(2,))


def test_padding_pads_and_counts_overruns() -> None:
    padding = SlotPadding(0.05)
    start = time.perf_counter()
    with padding:
        pass
    assert time.perf_counter() - start >= 0.05 and padding.overruns == 0
    with padding:
        time.sleep(0.06)
    assert padding.overruns == 1
    start = time.perf_counter()
    with SlotPadding(None):
        pass
    assert time.perf_counter() - start < 0.05
    with pytest.raises(ValueError, match="must be > 0"):
        SlotPadding(0.0)


def test_auto_chooses_from_every_ranks_profile() -> None:
    # 4 profiled slots and a step: the slower rank's 4 x 0.4 s, then 0.1 s once.
    profiles = (RankProfile(0.2, 1.7, 8 * 2**30), RankProfile(0.4, 1.65, 4 * 2**30))
    assert step_overhead(profiles) == pytest.approx(0.1)
    assert step_overhead((RankProfile(0.2, 0.5, 1.0),)) == 0.0  # never below nothing
    choice = choose(profiles, 12, accumulation=2, want_weights=True)
    assert choice.counts == (8, 4)
    assert choice.shard_weights == pytest.approx((2 / 3, 1 / 3))
    assert choice.predicted_step_seconds == pytest.approx(2 * 1.6 + 0.1)
    assert choice.even_step_seconds == pytest.approx(2 * 2.4 + 0.1)
    line = describe(choice)
    assert "--micro-batches-per-rank 8,4 --shard-weights 0.6667,0.3333" in line
    assert (
        "predicted step 3.300 s (even split: 4.900 s; slots measured, once per step: "
        "measured)" in line
    )
    # With the planner's terms, the once-per-step cost depends on the counts (the rows
    # padded to the largest block but rank 0's) and is the planner's, not the measured O.
    planned = choose(profiles, 12, 2, False, lambda c, w: 0.01 * max(c[1:]), "planner (x)")
    assert planned.predicted_step_seconds == pytest.approx(2 * 1.6 + 0.04)
    assert planned.even_step_seconds == pytest.approx(2 * 2.4 + 0.06)
    assert describe(planned).endswith("once per step: planner (x))")
    assert choose(profiles, 12, 1, want_weights=False).shard_weights is None
    # The first step (start-up) is left out: the median of 3.3, 3.63 and 3.0.
    assert prediction_check(choice, [9.0, 3.3, 3.63, 3.0]).startswith(
        "zero-train: auto: predicted step 3.300 s, measured median 3.300 s ("
    )
    assert "+10.0%" in prediction_check(choice, [3.63])


def test_counts_reach_the_engines_config(tmp_path: Path) -> None:
    from zero_models.train_engine_config import run_zero_config

    args = parse_options(["--out", str(tmp_path / "out"), "--micro-batches-per-rank", "2,1",
                          "--batch-size", "18"])  # fmt: skip
    assert args.virtual_total == 3 and args.stage == 3  # uneven counts run at stage 3 too
    assert run_zero_config(args).micro_batches_per_rank == (2, 1)
    auto = parse_options(["--out", str(tmp_path / "out"), "--micro-batches-per-rank", "auto"])
    assert auto.virtual_total == 8  # --batch-size 16 over 2 ranks: up to 4 slots each
    plain = parse_options(["--out", str(tmp_path / "out")])
    assert plain.virtual_total == 2 and run_zero_config(plain).micro_batches_per_rank is None
    assert plain.stage == 3
    equal = parse_options(["--out", str(tmp_path / "out"), "--micro-batches-per-rank", "2,2"])
    assert equal.stage == 3
    explicit = parse_options(["--out", str(tmp_path / "out"), "--micro-batches-per-rank", "2,1",
                              "--batch-size", "18", "--stage", "3"])  # fmt: skip
    assert run_zero_config(explicit).stage == 3  # taken, not refused or lowered


def test_an_option_the_engine_cannot_honour_is_refused_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A zero_core whose ZeroConfig lacks the field (one from before issue 52) stops the
    run naming the option, instead of training homogeneously without a word."""
    import dataclasses

    import zero_core
    from zero_models.hetero_options import hetero_settings

    @dataclasses.dataclass(frozen=True)
    class OldConfig:
        stage: int = 3

    monkeypatch.setattr(zero_core, "ZeroConfig", OldConfig)
    args = argparse.Namespace(micro_batches_per_rank=None, shard_weights=(2.0, 1.0))
    with pytest.raises(ValueError, match="--shard-weights: this zero_core's ZeroConfig has no"):
        hetero_settings(args)
    args = argparse.Namespace(micro_batches_per_rank=(2, 1), shard_weights=None)
    with pytest.raises(ValueError, match="no 'micro_batches_per_rank' field"):
        hetero_settings(args)
    assert (
        hetero_settings(argparse.Namespace(micro_batches_per_rank=None, shard_weights=None)) == {}
    )


def test_a_deepspeed_configs_micro_batch_is_one_slots(tmp_path: Path) -> None:
    """With --deepspeed a "GPU" is a virtual rank: 6 sequences per slot on 2,1 slots make
    a batch of 18; the config's stage (2 or 3) is the engine's with uneven counts."""
    from zero_models.train_engine_config import run_zero_config

    config = tmp_path / "ds.json"
    out = ["--out", str(tmp_path / "out")]
    for stage in (2, 3):
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 6,
                                      "zero_optimization": {"stage": stage}}))  # fmt: skip
        args = parse_options([*out, "--deepspeed", str(config), "--micro-batches-per-rank", "2,1"])
        assert args.batch_size == 18 and args.stage == stage
        zero = run_zero_config(args)
        assert zero.micro_batches_per_rank == (2, 1) and zero.stage == stage


@pytest.mark.parametrize("counts", [[], ["--micro-batches-per-rank", "2,1"]], ids=["plain", "2,1"])
def test_the_delayed_update_flag_reaches_the_engine_under_deepspeed(
    tmp_path: Path, counts: list[str]
) -> None:
    """--deepspeed CONFIG --delayed-parameter-update: the config has no such key, so the
    flag is added to the config's ZeroConfig (it was once dropped without a word), also
    beside the mixed-hardware options, which are added to the same config."""
    from zero_models.train_engine_config import run_zero_config

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 6, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}))  # fmt: skip
    common = ["--out", str(tmp_path / "out"), "--deepspeed", str(config), *counts]
    zero = run_zero_config(parse_options([*common, "--delayed-parameter-update"]))
    assert zero.delayed_parameter_update is True
    assert zero.offload_optimizer == "cpu"
    assert zero.micro_batches_per_rank == ((2, 1) if counts else None)
    assert run_zero_config(parse_options(common)).delayed_parameter_update is False


def test_the_planner_gives_the_once_per_step_cost_where_this_machine_is_calibrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """planner_overhead: the engine configuration's stage, bucket size and dtypes reach
    the planner's terms (zero_core.hetero.planned); without a calibration there is no
    planner cost, and auto falls back to the measured O."""
    import zero_core
    from zero_core.hetero.planned import planned_overhead
    from zero_core.plan import Cluster
    from zero_models.gpt import PRESETS
    from zero_models.hetero_profile import planner_overhead

    cluster = Cluster(
        name="test", nodes=1, devices_per_node=2, device_memory=1e9, peak_flops=1e12,
        compute_efficiency=1.0, memory_bandwidth=1e10, intra_bandwidth=1e9, intra_latency=1e-4,
        inter_bandwidth=1e9, inter_latency=1e-4, host_memory=1e10, host_bandwidth=1e10,
        host_optimizer_rate=1e8, disk_bandwidth=1e9, optimizer_rate=1e8, overlap=0.0,
        source="made up",
    )  # fmt: skip
    zc = zero_core.ZeroConfig(stage=2, bucket_numel=1 << 16, param_dtype=torch.bfloat16)
    config = PRESETS["small"]
    found = planner_overhead(zc, config, 2, torch.device("cpu"), 2, 0.1, cluster=cluster)
    assert found is not None
    overhead, source = found
    assert source == "planner (test: made up)"
    expected = planned_overhead((8, 4), cluster, params=config.num_params, stage=2,
                                bucket_numel=1 << 16, dtype_bytes=2, reduce_bytes=2,
                                accumulation=2, slot_seconds=0.1)  # fmt: skip
    assert overhead((8, 4), None) == pytest.approx(expected.total)
    assert overhead((6, 6), None) > overhead((8, 4), None)  # rows padded to 6, not 4
    # The profile's own step: one micro-step, even shards.
    assert overhead((4, 4), None, 1) == pytest.approx(
        planned_overhead((4, 4), cluster, params=config.num_params, stage=2,
                         bucket_numel=1 << 16, dtype_bytes=2, reduce_bytes=2,
                         accumulation=1, slot_seconds=0.1).total
    )  # fmt: skip
    monkeypatch.setenv("ZERO_PLAN_CALIBRATION", str(tmp_path / "none.json"))
    assert planner_overhead(zc, config, 2, torch.device("cpu"), 1, 0.1) is None


def test_the_planners_cost_is_scaled_to_the_profiles_measured_step() -> None:
    """A rank slower than the calibration (a CPU quota) runs its once-per-step work
    slower too: the planner's cost is scaled so that it gives the measured O at the
    profile's counts (4 slots each, one micro-step), keeping how it changes with counts."""
    from zero_models.hetero_profile import scaled_to_profile

    def planned(c: Sequence[int], w: Sequence[float] | None, steps: int | None = None) -> float:
        # 0.01 s per row rank 1 sends beyond 3, per micro-step (run: 2 a step).
        return 0.01 * max(0, max(c[1:]) - 3) * (steps or 2)

    # Measured: 4 x 0.4 s, then 0.3 s once; the planner says 0.01 s at (4, 4) and 1 step.
    profiles = (RankProfile(0.2, 1.7, 1.0), RankProfile(0.4, 1.9, 1.0))
    scaled, source = scaled_to_profile(planned, "planner (x)", profiles)
    assert scaled((4, 4), None) == pytest.approx(30 * planned((4, 4), None))
    assert scaled((5, 5), None) == pytest.approx(30 * 0.01 * 2 * 2)
    assert scaled((9, 3), None) == 0.0
    assert source == "planner (x) x 30.00 (the profile's measured step)"
    # Without a planned cost at the profile's step there is nothing to scale by.
    same, source = scaled_to_profile(lambda c, w, steps=None: 0.0, "planner (x)", profiles)
    assert same((8, 4), None) == 0.0 and source == "planner (x)"
    # The scaled cost decides the counts: at 2 micro-steps 8,4 takes 2 x 1.6 + 0.6 s and
    # 9,3 2 x 1.8 s, so 9,3; unscaled (0.02 s), 8,4 (3.22 s against 3.6 s).
    choice = choose(profiles, 12, 2, False, scaled, source)
    assert choice.predicted_step_seconds == pytest.approx(3.6)
    assert choose(profiles, 12, 2, False, lambda c, w: planned(c, w)).counts == (8, 4)
    assert choice.counts == (9, 3)
