"""zero-train: options are checked before any rank starts, and a short run trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_models.run_metrics import read_metrics


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zero_models.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stage", "4"], "--stage 4: ZeRO stages are 0-3"),
        (["--data", "/no/such/path"], "--data /no/such/path: no such file"),
        (["--model", "test", "--heads", "3"], "does not divide into heads=3"),
        (["--nproc", "0"], "must be at least 1"),
        (["--tp", "3"], "--tp 3 does not divide the 2 ranks"),
        (["--nproc", "4", "--tp", "4", "--model", "test"], "heads=2 does not divide over"),
        (["--offload-checkpoints"], "--offload-checkpoints needs --checkpoint full or"),
        (["--stage", "0", "--shard-group", "2"], "hybrid sharding needs stage 1 or more"),
        (["--nproc", "4", "--shard-group", "3"], "shard_group_size=3 does not divide the 4"),
        (["--nproc", "4", "--stage", "3", "--hpz", "3"], "hpz_partition_size=3: hpZ's group"),
        (
            ["--nproc", "4", "--shard-group", "2", "--quantize-gradients", "int4"],
            "quantize_gradients with shard_group_size",
        ),
        (
            ["--nproc", "4", "--deepspeed", "mics3.json"],
            "--deepspeed mics3.json: shard_group_size=3",
        ),
        (
            ["--tp", "2", "--model", "test", "--save-every", "2"],
            "checkpoints of tensor-parallel runs are not supported yet",
        ),
        (["--clip", "nan"], "--clip nan must be a gradient norm >= 0"),
        (["--warmup", "-1"], "--warmup -1 must be 0 or more steps"),
        (["--sample-tokens", "-1"], "--sample-tokens -1 must be 0 (no sample) or more"),
        (["--comm-timeout", "0"], "--comm-timeout 0.0 must be a number of seconds > 0"),
        (
            ["--heartbeat-timeout", "inf"],
            "--heartbeat-timeout inf must be a number of seconds > 0",
        ),
        (["--threads", "100000"], "--threads 100000 is more than 4 per core"),
        (["--out", "afile/sub"], "--out afile/sub: cannot make the results folder"),
        (["--model", "test", "--data", "big.u16"], "token id 65000 is beyond the model's vocab"),
        (
            ["--deepspeed", "empty.json", "--stage", "1", "--dtype", "bf16"],
            "rules --stage 1 (the config gives 2), --dtype bf16 (the config gives fp32)",
        ),
        (["--deepspeed", "lr.json"], "optimizer.params {'lr': 'fast'}: AdamW refuses them"),
        (["--config", "self.json"], "a config cannot name another config"),
        (["--resume", "cut"], "--resume cut: checkpoint cut: cut/rank-00000.safetensors: 3 bytes"),
        (["--data", "empty.txt"], "--data empty.txt: empty; give a file"),
        (["--data", "short.txt"], "short.txt: 3 tokens, and a sequence of --context 128 needs"),
        (["--stage", "3", "--optimizer-in-backward"], "combined with clip_grad_norm=1.0"),
        (["--stage", "2", "--clip", "0", "--optimizer-in-backward"], "stage=2 (it needs stage 3"),
        (["--deepspeed", "ds.json", "--optimizer-in-backward"], "with --deepspeed: a DeepSpeed"),
        (["--stage", "2", "--delayed-parameter-update"], "needs the optimizer offloaded"),
        (["--deepspeed", "empty.json", "--delayed-parameter-update"], "with --deepspeed: del"),
        (["--reduce-dtype", "bf16"], "would round every torch.float32 gradient"),
        (["--deepspeed", "empty.json", "--reduce-dtype", "fp32"], "--reduce-dtype with --deep"),
    ],
)
def test_wrong_options_stop_before_launching(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In process (a start of the command costs ~2 s of importing torch here): main stops
    with exit 2 before it launches a rank. test_resume_from_nothing_stops_before_launching
    runs the same path as a command."""
    from zero_models.train import main

    monkeypatch.chdir(tmp_path)
    Path("mics3.json").write_text(json.dumps({"zero_optimization": {"mics_shard_size": 3}}))
    Path("empty.txt").write_text("")
    Path("short.txt").write_text("abc")
    Path("afile").write_text("")
    Path("big.u16").write_bytes(bytes([0xE8, 0xFD]) * 200)  # token 65000, 200 times
    Path("empty.json").write_text("{}")
    Path("lr.json").write_text(
        json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})
    )
    Path("self.json").write_text(json.dumps({"config": "self.json"}))
    Path("cut").mkdir()
    index = {"format": "zero-checkpoint", "version": 1, "groups": [{"params": [["w", [1]]]}],
             "ranks": [{"file": {"bytes": 9, "block_bytes": 8, "crc32": [0]},
                        "pieces": [[[0, 0, 1, 0]]]}]}  # fmt: skip
    Path("cut/index.json").write_text(json.dumps(index))
    Path("cut/rank-00000.safetensors").write_bytes(b"abc")
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert "step" not in out


def test_a_short_run_on_two_ranks_trains_and_reports(tmp_path: Path) -> None:
    result = run("--model", "test", "--steps", "12", "--batch-size", "8", "--lr", "1e-2",
                 "--warmup", "2", "--out", str(tmp_path / "out"), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    _, records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(12))
    assert records[-1]["loss"] < records[0]["loss"]
    for expected in ("memory per rank", "communication in the last step", "sample:"):
        assert expected in result.stdout
    # Stage 3 keeps backward's first units from forward: the volume to compare with is the
    # paper's less those units' second gather (this model's many small parameters are kept
    # whole, so it moves less still).
    line = re.search(
        r"3Ψ\(N-1\)/N = ([\d,]+) .* less \(N-1\)/N of the ([\d,]+) elements kept .*: "
        r"([\d,]+); ratio",
        result.stdout,
    )
    assert line is not None, result.stdout
    paper, kept, less = (int(group.replace(",", "")) for group in line.groups())
    assert kept > 0 and less == paper - kept // 2, result.stdout
    # The README's next steps: the run saved its end (--final-save is the default), so
    # zero-consolidate reads it and --resume auto finds nothing left to train.
    from zero_core.checkpoint.consolidate import main as consolidate

    checkpoint = tmp_path / "out" / "checkpoint"
    assert (checkpoint / "latest").read_text().strip() == "global_step12"
    saved = checkpoint / "global_step12" / "index.json"
    assert json.loads(saved.read_text())["extra"]["step"] == 12
    assert consolidate([str(checkpoint), str(tmp_path / "model.safetensors")]) == 0
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    again = run("--model", "test", "--steps", "12", "--batch-size", "8", "--lr", "1e-2",
                "--warmup", "2", "--out", "out", "--resume", "auto", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "is at step 12, the end of this run (12 steps): nothing to train" in again.stdout


def test_resume_auto_over_results_without_a_checkpoint_starts_over(tmp_path: Path) -> None:
    """--resume auto where a run left results but no checkpoint (--no-final-save, or a job
    cut off before its first save) starts from step 1 in place of them, as its help says;
    without auto the folder is refused as another run's."""
    from zero_models.train_options import parse_options

    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "metrics.jsonl").write_text("{}\n")
    args = parse_options(["--out", str(tmp_path / "o"), "--resume", "auto"])
    assert args.resume is None and args.fresh_after_auto
    with pytest.raises(SystemExit):
        parse_options(["--out", str(tmp_path / "o")])
    assert not parse_options(["--out", str(tmp_path / "o"), "--overwrite"]).fresh_after_auto
    assert parse_options(["--out", str(tmp_path / "p"), "--no-final-save"]).final_save is False


def test_reduce_dtype_reaches_the_engines_config(tmp_path: Path) -> None:
    from zero_models.train_engine_config import run_zero_config
    from zero_models.train_options import parse_options

    out = ["--out", str(tmp_path / "o")]
    wide = run_zero_config(parse_options([*out, "--dtype", "bf16", "--reduce-dtype", "fp32"]))
    assert wide.param_dtype is torch.bfloat16 and wide.reduce_dtype is torch.float32
    assert run_zero_config(parse_options([*out, "--dtype", "bf16"])).reduce_dtype is None


def test_no_offload_gradients_keeps_them_on_the_device(tmp_path: Path) -> None:
    """Gradients follow --offload-optimizer by default; --no-offload-gradients keeps them."""
    from zero_models.train_engine_config import run_zero_config
    from zero_models.train_options import parse_options

    run = ["--out", str(tmp_path / "o"), "--stage", "2", "--offload-optimizer", "cpu"]
    assert run_zero_config(parse_options(run)).gradients_offloaded
    kept = run_zero_config(parse_options([*run, "--no-offload-gradients"]))
    assert kept.offload_gradients is False and not kept.gradients_offloaded


def test_tensor_parallel_times_data_parallel_run(tmp_path: Path) -> None:
    """TP 2 x DP 2 with P_a: the per-phase memory table reports each rank's checkpoints,
    half of a whole block input per layer (2 layers x 2 sequences x 32 tokens x 32 wide /
    2 ranks x 4 bytes = 8 KiB)."""
    result = run("--model", "test", "--steps", "4", "--nproc", "4", "--tp", "2",
                 "--batch-size", "4", "--sample-tokens", "8", "--out", str(tmp_path / "o"),
                 "--checkpoint", "partitioned", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 ranks (2 tensor-parallel x 2 data-parallel)" in result.stdout
    assert "tensor-parallel layers moved" in result.stdout
    table = result.stdout.split("peak memory of the last step per phase")[1].splitlines()
    rows = [line.split() for line in table[3:7]]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert all(r[4] == f"{8192 / 2**20:.1f}" for r in rows), table
    assert "predicted (zero_core.estimate.activations): kept 0.0" in result.stdout


def test_options_from_a_json_config_and_unknown_keys(tmp_path: Path) -> None:
    from zero_models.train_options import parse_options

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"steps": 7, "model": "test", "lr": 0.01}))
    args = parse_options(["--config", str(config), "--steps", "9"])
    assert (args.steps, args.model, args.lr) == (9, "test", 0.01)  # flags override the file
    config.write_text(json.dumps({"stepz": 7}))
    result = run("--config", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "unknown keys ['stepz']" in result.stderr


@pytest.mark.mpi
def test_under_mpiexec_the_launchers_ranks_are_used(tmp_path: Path) -> None:
    from zero_comm.testing import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec: pip install mpich mpi4py (nox -s tests_mpi does)")
    result = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "zero_models.train",
         "--backend", "mpi", "--model", "test", "--steps", "3", "--sample-tokens", "4",
         "--out", str(tmp_path / "o")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks (1 tensor-parallel x 2 data-parallel) on mpi" in result.stdout


# The SIGTERM test (resume auto; test_run_control.py) and tests/test_faults.py resume
# zero-train bit for bit in the default run; zero-core's checkpoint tests resume at every
# stage and world size.
@pytest.mark.slow
def test_resume_continues_bit_for_bit_at_any_stage(tmp_path: Path) -> None:
    """6 steps (stage 3, 2 ranks); a run of 3 steps that saves; resumed from that
    checkpoint at stage 3 and at stage 1: steps 4-6 have exactly the losses (full float
    precision in metrics.jsonl) of the run that never stopped."""
    common = ["--model", "test", "--steps", "6", "--batch-size", "4", "--sample-tokens", "4"]
    whole = run(*common, "--save-every", "3", "--out", "a", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    checkpoint = tmp_path / "a" / "checkpoint"
    losses = losses_of(tmp_path / "a/metrics.jsonl")
    partial = run(*common, "--stop-after", "3", "--save-every", "3", "--out", "b", cwd=tmp_path)
    assert partial.returncode == 0, partial.stderr
    for extra in ([], ["--stage", "1"]):
        out = f"c{len(extra)}"
        resumed = run(*common, "--resume", str(tmp_path / "b/checkpoint"), "--out", out,
                      *extra, cwd=tmp_path)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
        assert "DeterminismWarning" not in resumed.stderr
        again = losses_of(tmp_path / out / "metrics.jsonl")
        assert again == losses[3:], (extra, again, losses)
    assert checkpoint.exists()


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_the_optimizer_step_in_backward_trains_with_the_same_bits(
    checkpoint: str, tmp_path: Path
) -> None:
    """zero-train --optimizer-in-backward (stage 3, no clipping) has every loss of the run
    without it, to the last bit (metrics.jsonl keeps full float precision), also with
    every block recomputed in backward (its gathers happen while buckets are stepped)."""
    common = ["--model", "test", "--stage", "3", "--clip", "0", "--steps", "4",
              "--batch-size", "4", "--sample-tokens", "4", "--checkpoint", checkpoint]  # fmt: skip
    plain = run(*common, "--out", "plain", cwd=tmp_path)
    fused = run(*common, "--optimizer-in-backward", "--out", "fused", cwd=tmp_path)
    assert plain.returncode == 0 and fused.returncode == 0, plain.stderr + fused.stderr
    losses = losses_of(tmp_path / "plain/metrics.jsonl")
    assert len(losses) == 4 and len(set(losses)) == 4
    assert losses_of(tmp_path / "fused/metrics.jsonl") == losses


def test_the_delayed_parameter_update_trains_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """zero-train --delayed-parameter-update (from a --config JSON key too), host offload,
    2 ranks: step 1 has the synchronous run's loss (both compute with the initial
    weights), later steps compute with weights one update older, so they differ; a run
    that stops and saves after step 3 (the save publishes step 3's update) and resumes has
    the losses of the run that saved after step 3 and went on."""
    common = ["--model", "test", "--stage", "2", "--offload-optimizer", "cpu", "--steps", "6",
              "--batch-size", "4", "--sample-tokens", "4"]  # fmt: skip
    (tmp_path / "dpu.json").write_text(json.dumps({"delayed_parameter_update": True}))
    delayed = ["--config", str(tmp_path / "dpu.json")]
    plain = run(*common, "--out", "plain", cwd=tmp_path)
    whole = run(*common, *delayed, "--save-every", "3", "--out", "a", cwd=tmp_path)
    assert plain.returncode == 0 and whole.returncode == 0, plain.stderr + whole.stderr
    synchronous, losses = (
        losses_of(tmp_path / "plain/metrics.jsonl"),
        losses_of(tmp_path / "a/metrics.jsonl"),
    )
    assert losses[0] == synchronous[0] and losses[1:] != synchronous[1:]
    partial = run(*common, "--delayed-parameter-update", "--stop-after", "3", "--save-every",
                  "3", "--out", "b", cwd=tmp_path)  # fmt: skip
    assert partial.returncode == 0, partial.stderr
    resumed = run(*common, "--delayed-parameter-update", "--resume",
                  str(tmp_path / "b/checkpoint"), "--out", "c", cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert losses_of(tmp_path / "c/metrics.jsonl") == losses[3:]


def losses_of(metrics: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(metrics)[1]]


# The golden-loss prefix (test_golden_losses) checks a run's bits against a stored run.
@pytest.mark.slow
def test_two_runs_of_the_same_command_give_the_same_bits(tmp_path: Path) -> None:
    """The default thread count (cores / ranks, OMP_NUM_THREADS unset) is fixed per rank
    and reported; two runs of one command have equal run records and equal losses."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    common = ["--model", "test", "--steps", "5", "--batch-size", "4", "--sample-tokens", "4"]
    records = []
    for out in ("a", "b"):
        result = run(*common, "--out", out, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        threads = max(1, (os.cpu_count() or 1) // 2)
        assert f"{threads} thread" in result.stdout and "cores / 2 ranks" in result.stdout
        records.append(read_metrics(tmp_path / out / "metrics.jsonl"))
    (run_a, steps_a), (run_b, steps_b) = records
    assert run_a[0]["fingerprint"] == run_b[0]["fingerprint"]
    assert run_a[0]["fingerprint"]["intra_op_threads"] == threads
    assert [r["loss"] for r in steps_a] == [r["loss"] for r in steps_b]


# zero-core's test_a_resume_under_other_threads_warns_once_naming_the_difference checks the
# warning itself; this is the same through zero-train.
@pytest.mark.slow
def test_a_resume_with_other_threads_warns_and_names_both(tmp_path: Path) -> None:
    common = ["--model", "test", "--steps", "4", "--batch-size", "4", "--sample-tokens", "4"]
    saved = run(*common, "--threads", "1", "--stop-after", "2", "--save-every", "2",
                "--out", "a", cwd=tmp_path)  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    resumed = run(*common, "--threads", "2", "--resume", "a/checkpoint", "--out", "b",
                  cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "saved with threads per rank 1, resumed with 2" in resumed.stderr
    # rank 0 only, as one line (zero-train shows our warnings as notes)
    assert resumed.stderr.count("zero-train: note: checkpoint") == 1, resumed.stderr
    runs, _ = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert runs[0]["first_step"] == 2 and runs[0]["fingerprint"]["intra_op_threads"] == 2


@pytest.mark.parametrize(
    ("requested", "variable", "expected"),
    [(3, "1", (3, "--threads")), (None, "5", (5, "OMP_NUM_THREADS")), (None, None, None)],
)
def test_threads_per_rank_comes_from_the_flag_the_variable_or_the_cores(
    requested: int | None, variable: str | None, expected: tuple[int, str] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from zero_models.train_options import threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    if variable is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert threads_per_rank(requested, 4) == (2, "8 cores / 4 ranks on this node")
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", variable)
        assert threads_per_rank(requested, 4) == expected


def test_resume_from_nothing_stops_before_launching(tmp_path: Path) -> None:
    result = run("--resume", "nowhere", cwd=tmp_path)
    assert result.returncode == 2 and "--resume nowhere: no checkpoint there" in result.stderr


def test_a_json_config_of_any_content_is_accepted_or_stops_with_usage(tmp_path: Path) -> None:
    """Fuzzed --config files (arbitrary JSON, and values of every JSON type for every
    option) either parse or stop with argparse's usage error (exit 2): never a traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from zero_models.train_options import parse_options, parser

    keys = [a.dest for a in parser()._actions if a.dest not in ("help", "config")]
    scalars = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text(max_size=8)
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=5,
    )
    documents = (
        st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), values, max_size=4) | values
    )
    config = tmp_path / "fuzz.json"

    @settings(
        max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(document=documents)
    def check(document: object) -> None:
        config.write_text(json.dumps(document))
        try:
            parse_options(["--config", str(config), "--steps", "3"])
        except SystemExit as stop:
            assert stop.code == 2

    check()


# --resume auto with a checkpoint is checked by the SIGTERM test (test_run_control.py), in
# the default run.
@pytest.mark.slow
def test_resume_auto_without_a_checkpoint_starts_fresh_and_overwrite_replaces(
    tmp_path: Path,
) -> None:
    common = ["--model", "test", "--steps", "2", "--batch-size", "4", "--sample-tokens", "4"]
    fresh = run(*common, "--out", "o", "--resume", "auto", cwd=tmp_path)
    assert fresh.returncode == 0 and "resumed" not in fresh.stdout, fresh.stderr
    again = run(*common, "--out", "o", "--save-every", "1", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    runs, steps = read_metrics(tmp_path / "o" / "metrics.jsonl")
    assert len(runs) == 1 and len(steps) == 2  # replaced, not appended
    # Requeued after it finished: its checkpoint is at the end step; it says so (once
    # this crashed every rank in the report, which had no step to read).
    done = run(*common, "--out", "o", "--resume", "auto", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "at step 2, the end of this run (2 steps): nothing to train" in done.stdout
    assert "Traceback" not in done.stderr
    replaced = run(*common, "--out", "o", "--overwrite", "--no-final-save", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert not (tmp_path / "o" / "checkpoint").exists()  # the old run's state went with it


def test_a_deepspeed_config_drives_the_run(tmp_path: Path) -> None:
    """Hugging Face's shape of config: its stage, precision, batch sizes, optimizer and
    WarmupLR schedule replace the flags, 'auto' takes the flags' values; the metrics'
    learning rates are the schedule's."""
    import math

    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                 "warmup_num_steps": 4, "warmup_type": "linear"}},
        "steps_per_print": 10,
    }  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = run("--model", "test", "--steps", "3", "--sample-tokens", "4", "--deepspeed",
                 "ds.json", "--out", "o", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "stage 2" in result.stdout and "bf16" in result.stdout
    assert "accepted without effect" in result.stderr and "steps_per_print" in result.stderr
    _, steps = read_metrics(tmp_path / "o" / "metrics.jsonl")
    # as DeepSpeed's WarmupLR: the first two updates at warmup_min_lr, then 1/4, 2/4, ...
    assert [s["lr"] for s in steps] == [0.0, 0.0, 1e-3 / 4]
    assert all(math.isfinite(s["loss"]) for s in steps)

    (tmp_path / "bad.json").write_text(json.dumps({**config, "train_batch_size": 6}))
    refused = run("--model", "test", "--deepspeed", "bad.json", cwd=tmp_path)
    assert refused.returncode == 2
    assert "train_batch_size=6 does not divide into 2 x 2 ranks" in refused.stderr


# zero-train whose every rank (or only rank ZERO_TEST_CAPPED_RANK) may take BUDGET MiB of
# address space more than it holds once started (RLIMIT_AS, set as the build begins, as
# tools/peers/bench.py's probes do): each rank runs this file instead of
# `-m zero_models.train`, through zero-train's own launch.
CAPPED_TRAIN = """
import os, resource, sys
import torch._dynamo  # imported on first use in the build: not the model's memory
import zero_models.run_setup as run_setup
import zero_models.train as train
from zero_core.memory.proc_status import process_status_kib

budget, footprint, launch = int(sys.argv[1]) << 20, run_setup.run_footprint, train.launch

def capped_footprint(*args, **kwargs):
    if os.environ.get("ZERO_TEST_CAPPED_RANK", os.environ["RANK"]) == os.environ["RANK"]:
        mapped = process_status_kib("VmSize") * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mapped + budget, resource.RLIM_INFINITY))
    return footprint(*args, **kwargs)

def launch_capped(command, world_size, **kwargs):  # command: python -m zero_models.train ...
    return launch([sys.executable, __file__, sys.argv[1], *command[3:]], world_size, **kwargs)

run_setup.run_footprint, train.launch = capped_footprint, launch_capped
train.main(sys.argv[2:])
"""


def run_capped(
    budget_mib: int, *args: str, cwd: Path, rank: int | None = None
) -> subprocess.CompletedProcess[str]:
    """zero-train on 2 ranks (fp32, stage 3, 200 kB of text), each rank (or only
    ``rank``) capped at ``budget_mib`` MiB of address space more than it held before the
    build."""
    (cwd / "capped_train.py").write_text(CAPPED_TRAIN)
    (cwd / "text.txt").write_bytes(bytes(range(32, 127)) * 2000)
    command = [sys.executable, "capped_train.py", str(budget_mib), "--data", "text.txt",
               "--steps", "2", "--sample-tokens", "4", "--out", "o", *args]  # fmt: skip
    env = {**os.environ, **({} if rank is None else {"ZERO_TEST_CAPPED_RANK": str(rank)})}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def one_line_per_rank(result: subprocess.CompletedProcess[str], phase: str) -> list[str]:
    """The job ended with EXIT_OUT_OF_MEMORY and, on stderr, one line from each rank
    saying it ran out of memory in ``phase`` (a regular expression), nothing else."""
    from zero_models.out_of_memory import EXIT_OUT_OF_MEMORY

    assert result.returncode == EXIT_OUT_OF_MEMORY, result.stderr[-3000:]
    lines = sorted(line for line in result.stderr.splitlines() if line.strip())
    assert len(lines) == 2, result.stderr[-3000:]
    for rank, line in enumerate(lines):
        start = rf"\[rank {rank}\] out of memory in {phase} at stage 3 \(fp32, 2 ranks\)"
        assert re.match(start, line), line
    return lines


def test_out_of_memory_in_the_build_ends_in_one_line_per_rank(tmp_path: Path) -> None:
    """GPT-2 small at stage 3 on 2 ranks holds 0.92 GiB of model states per rank (fp32
    Adam: 16 bytes x 124M / 2): under a 300 MiB cap its build fails, and each rank
    says so in one line, with zero-estimate's bytes and the tiers that keep the least."""
    from zero_core.estimate.model_states import model_state_bytes
    from zero_models.gpt import PRESETS

    result = run_capped(300, "--model", "gpt2", "--context", "64", "--batch-size", "2",
                        cwd=tmp_path)  # fmt: skip
    params = PRESETS["gpt2"].with_overrides(context=64).num_params
    states = model_state_bytes(params, 2, 3, optimizer_state_bytes=8, param_bytes=4, grad_bytes=4)
    for line in one_line_per_rank(result, "the build"):
        assert f"zero-estimate predicts {states.total / 2**30:.2f} GiB of model states" in line
        assert "--offload-optimizer disk --offload-params disk --offload-dir DIR" in line


def test_out_of_memory_in_a_step_ends_in_one_line_per_rank(tmp_path: Path) -> None:
    """The test GPT's build fits in 200 MiB, its first forward (4096 sequences of 32
    tokens: ~0.5 GiB of activations per rank) does not: one line per rank naming the
    phase and step, and activation checkpointing as what keeps the least."""
    result = run_capped(200, "--model", "test", "--batch-size", "4096", cwd=tmp_path)
    for line in one_line_per_rank(result, r"the (forward|backward) of step 1"):
        assert "zero-estimate predicts 0.3 MiB of model states per rank + 0.52 GiB" in line
        assert "--checkpoint full would keep" in line


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_out_of_memory_is_named_by_the_survivor_in_one_line(
    dead: int, tmp_path: Path
) -> None:
    """Only rank ``dead`` is capped (200 MiB): it runs out of memory in the forward of
    step 1, prints its line, tells its peer it leaves and ends. The survivor, waiting on
    it in a collective (rank 1 dead: the rendezvous store rank 0 hosts lives on; rank 0
    dead: the store goes with it), prints one line naming it, in the seconds zero-launch
    gives it after the first rank's end, with none of c10d's C++ warnings and stacks."""
    from zero_models.out_of_memory import EXIT_OUT_OF_MEMORY

    result = run_capped(200, "--model", "test", "--batch-size", "4096", cwd=tmp_path, rank=dead)
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.stderr[-3000:]
    for noise in ("Exception raised from", "frame #", "c10d", "TCPStore", "Traceback"):
        assert noise not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, result.stderr[-3000:]
    died = next(line for line in lines if line.startswith(f"[rank {dead}] "))
    assert died.startswith(f"[rank {dead}] out of memory in the forward of step 1"), died
    survivor = next(line for line in lines if line.startswith(f"[rank {1 - dead}] "))
    assert survivor.startswith(
        f"[rank {1 - dead}] stopped in the forward of step 1: PeerFailureError: "
    ), survivor
    if dead == 1:  # it told the survivor why, through the store that outlives it
        assert "rank 1 (host " in survivor, survivor
        assert "left the job (it ran out of memory in the forward of step 1)" in survivor
    else:  # its store went with it
        assert "rank 0 (host " in survivor and "is dead" in survivor, survivor


def test_what_counts_as_running_out_of_memory() -> None:
    import torch

    from zero_models.out_of_memory import failed_allocation, is_out_of_memory

    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 154389504 bytes. Error code 12 (Cannot allocate memory)"
    )
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ...")
    assert is_out_of_memory(cpu) and failed_allocation(cpu) == "0.14 GiB"
    assert is_out_of_memory(cuda) and failed_allocation(cuda) == "2.00 GiB"
    assert is_out_of_memory(MemoryError()) and failed_allocation(MemoryError()) == ""
    try:  # raised while handling one: a swap thread's, a hook's
        try:
            raise MemoryError
        except MemoryError as exc:
            raise RuntimeError("[rank 1] step of tile 3 failed") from exc
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_line_names_zero_estimates_bytes_and_the_cheapest_change_that_fits() -> None:
    """The issue's case: GPT-2 medium at stage 3 on 2 ranks in bf16 (1024 tokens per rank),
    about 1.3 GiB left to each rank by a 2.5 GB cap. zero-estimate's 16 bytes x 355M / 2
    = 2.64 GiB of model states per rank: only the optimizer's disk tier (with which the
    gradients go to disk too) and activation checkpointing together fit; the parameters
    may stay (on a GPU, whose host memory is another place, the host tier does)."""
    import zero_core
    from zero_core.estimate.activations import TransformerShape
    from zero_core.estimate.model_states import model_state_bytes
    from zero_models.gpt import PRESETS
    from zero_models.out_of_memory import Footprint, Placement, out_of_memory_line

    gpt = PRESETS["gpt2-medium"]
    shape = TransformerShape(gpt.layers, gpt.width, gpt.heads, gpt.vocab_size, 1024)
    run = Footprint(gpt.num_params, 2, 2, 1, "bf16", Placement(3, "none", "none", "none"),
                    shape, "cpu", zero_core.ZeroConfig(stage=3), 4.0 * gpt.vocab_size * gpt.width,
                    1.3 * 2**30)  # fmt: skip
    line = out_of_memory_line(1, "the build", run, MemoryError())
    states = model_state_bytes(gpt.num_params, 2, 3).total / 2**30
    assert line.startswith(
        f"[rank 1] out of memory in the build at stage 3 (bf16, 2 ranks): zero-estimate "
        f"predicts {states:.2f} GiB of model states per rank + 1.33 GiB of activations; this "
        "rank had about 1.30 GiB free; --checkpoint full --offload-optimizer disk "
        "--offload-dir DIR would keep "
    ), line
    on_gpu = out_of_memory_line(1, "the build", run._replace(device="cuda"), MemoryError())
    assert "; --checkpoint full --offload-optimizer cpu" in on_gpu and "disk" not in on_gpu
    # The optimizer stepped in backward: 14 bytes per parameter / N in bf16 (one bucket
    # slice of gradients), and no offload tier to suggest, since it refuses them.
    fused = zero_core.ZeroConfig(stage=3, optimizer_in_backward=True, nonfinite="raise")
    line = out_of_memory_line(1, "the build", run._replace(zero=fused), MemoryError())
    slice_bytes = gpt.vocab_size * gpt.width / 2 * (2 + 4)  # the embedding is the largest
    states = (14 * gpt.num_params / 2 + slice_bytes) / 2**30
    assert f"predicts {states:.2f} GiB of model states" in line, line
    assert "offload" not in line and "; even --checkpoint full would keep" in line, line


def test_our_warnings_reach_the_user_as_one_line() -> None:
    """A note from zero_core (hpZ without effect, DeepSpeed keys without effect) is one
    line under zero-train; a warning from anyone else keeps Python's form, source line
    and all."""
    import zero_core.hybrid_sharding as ours
    from zero_models.train import note_line

    mine = note_line(UserWarning("hpZ has no effect"), UserWarning, ours.__file__, 7)
    assert mine == "zero-train: note: hpZ has no effect\n"
    theirs = note_line(UserWarning("x"), UserWarning, "/site/torch/nn/module.py", 3, "y = 1")
    assert theirs.startswith("/site/torch/nn/module.py:3: UserWarning: x") and "y = 1" in theirs


def test_a_run_far_beyond_the_nodes_memory_is_refused_before_launch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--context 1000000: zero-estimate's figure for a rank is far beyond what this node
    has (a probe ran it for minutes in its first step; a larger one was killed by the
    kernel without a word), so main stops before launching, naming both and what would
    fit; the default run is not touched by the check."""
    from zero_models.run_setup import prelaunch_memory_problem
    from zero_models.train import main
    from zero_models.train_options import parse_options

    assert prelaunch_memory_problem(parse_options(["--model", "test"])) == ""
    with pytest.raises(SystemExit) as stop:
        main(["--model", "test", "--context", "1000000", "--out", "big"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("zero-train: error: each rank would need about ") and "has about" in err
