"""Wrong inputs across the packages, one row each: the documented error type, and a message
that names the offending value and says what to change.

Each row is (what is wrong, a function that does it, the error type, a regular expression
the message must match). Engine and communicator rows run on a simulated world.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_comm
import zero_core
from zero_comm import Communicator, run_simulated
from zero_comm.errors import BackendUnavailableError
from zero_core import CheckpointError, ZeroConfig
from zero_models.data import BatchSampler, load_tokens
from zero_models.gpt import GPT, PRESETS, GPTConfig
from zero_models.tp_plan import check_tp_degree


def on_one_rank(body: Callable[[Communicator], Any]) -> Callable[[], Any]:
    """Run ``body`` on a simulated world of one rank, re-raising its own error."""

    def run() -> Any:
        try:
            return run_simulated(1, body)
        except zero_comm.simulated.SimulatedRankError as failure:
            raise failure.__cause__ from None  # type: ignore[misc]

    return run


def engine(model: nn.Module | None = None, **config: Any) -> Callable[[], Any]:
    def body(comm: Communicator) -> Any:
        m = model or nn.Linear(2, 2)
        return zero_core.initialize(m, torch.optim.AdamW, ZeroConfig(**config), comm,
                                    optimizer_kwargs={"lr": 0.1})  # fmt: skip

    return on_one_rank(body)


def frozen_model() -> nn.Module:
    m = nn.Linear(2, 2)
    m.requires_grad_(False)
    return m


def freeze_between_steps(comm: Communicator) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    e = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ZeroConfig(stage=3), comm)  # fmt: skip
    e.backward(e(torch.ones(1, 2)).sum())
    e.step()
    model[0].weight.requires_grad_(False)
    e.backward(e(torch.ones(1, 2)).sum())


def backward_twice(comm: Communicator) -> None:
    e = zero_core.initialize(nn.Linear(2, 2), torch.optim.SGD, ZeroConfig(stage=2), comm,
                             optimizer_kwargs={"lr": 0.1})  # fmt: skip
    e.backward(e(torch.ones(1, 2)).sum())
    e.backward(e(torch.ones(1, 2)).sum())


def lbfgs(comm: Communicator) -> None:
    m = nn.Linear(2, 2)
    zero_core.initialize(m, torch.optim.LBFGS(m.parameters()), ZeroConfig(), comm)


def meta_without_values(comm: Communicator) -> None:
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    zero_core.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), ZeroConfig(stage=3), comm)


def collective(call: Callable[[Communicator], Any]) -> Callable[[], Any]:
    return on_one_rank(call)


def write(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def saved_checkpoint(tmp: Path, config: GPTConfig) -> Path:
    folder = tmp / f"ckpt-{config.vocab_size}-{config.width}"

    def body(comm: Communicator) -> None:
        model = GPT(config)
        e = zero_core.initialize(model, torch.optim.AdamW(model.parameters()),
                                 ZeroConfig(stage=2), comm)  # fmt: skip
        e.save(folder.parent, tag=folder.name)

    run_simulated(2, body)
    return folder


def load_into(folder: Path, config: GPTConfig) -> Callable[[], Any]:
    def body(comm: Communicator) -> None:
        model = GPT(config)
        e = zero_core.initialize(model, torch.optim.AdamW(model.parameters()),
                                 ZeroConfig(stage=3), comm)  # fmt: skip
        e.load(folder)

    return on_one_rank(body)


def train_options(*argv: str) -> Callable[[], Any]:
    from zero_models.train_options import parse_options

    return lambda: parse_options(list(argv))


Row = tuple[str, Callable[[], Any], type[BaseException], str]


def rows(tmp: Path) -> list[Row]:
    small = PRESETS["test"]
    other_vocab = (
        small.with_overrides(vocab_size=300) if hasattr(small, "with_overrides") else small
    )
    ckpt = saved_checkpoint(tmp, small)
    return [
        (
            "stage 4",
            lambda: ZeroConfig(stage=4),
            ValueError,
            r"stage=4: ZeRO stages are 0, 1, 2 and 3",
        ),
        ("stage -1", lambda: ZeroConfig(stage=-1), ValueError, r"stage=-1"),
        ("stage as text", lambda: ZeroConfig(stage="2"), ValueError, r"stage='2'"),  # type: ignore[arg-type]
        (
            "bucket 0",
            lambda: ZeroConfig(bucket_numel=0),
            ValueError,
            r"bucket_numel=0 must be an integer >= 1",
        ),
        ("bucket -5", lambda: ZeroConfig(bucket_numel=-5), ValueError, r"bucket_numel=-5"),
        (
            "accumulation 0",
            lambda: ZeroConfig(gradient_accumulation_steps=0),
            ValueError,
            r"gradient_accumulation_steps=0",
        ),
        (
            "in flight 0",
            lambda: ZeroConfig(max_buckets_in_flight=0),
            ValueError,
            r"max_buckets_in_flight=0",
        ),
        (
            "prefetch -1",
            lambda: ZeroConfig(prefetch_numel=-1),
            ValueError,
            r"prefetch_numel=-1 must be",
        ),
        (
            "threshold 1.5",
            lambda: ZeroConfig(persistence_threshold=1.5),
            ValueError,  # type: ignore[arg-type]
            r"persistence_threshold=1.5",
        ),
        (
            "int8 compute",
            lambda: ZeroConfig(param_dtype="int8"),
            ValueError,  # type: ignore[arg-type]
            r"param_dtype='int8' is not supported; use one of float32, bfloat16, float16",
        ),
        (
            "nonfinite policy",
            lambda: ZeroConfig(nonfinite="ignore"),
            ValueError,
            r"nonfinite='ignore' must be 'skip' or 'raise'",
        ),
        (
            "clip as text",
            lambda: ZeroConfig(clip_grad_norm="1"),
            ValueError,  # type: ignore[arg-type]
            r"clip_grad_norm='1' must be a number",
        ),
        (
            "unknown DeepSpeed key",
            lambda: ZeroConfig.from_deepspeed({"zero_optimisation": {}}),
            ValueError,
            r"zero_optimisation",
        ),
        (
            "unknown DeepSpeed sub-key",
            lambda: ZeroConfig.from_deepspeed({"zero_optimization": {"cpu_ofload": True}}),
            ValueError,
            r"zero_optimization\.cpu_ofload is not supported",
        ),
        (
            "DeepSpeed fp16 master weights",
            lambda: ZeroConfig.from_deepspeed({"fp16": {"fp16_master_weights_and_grads": True}}),
            ValueError,
            r"fp16\.fp16_master_weights_and_grads=True is not supported: zero_core keeps float32",
        ),
        (
            "DeepSpeed keys that cannot be honoured, all in one message",
            lambda: ZeroConfig.from_deepspeed(
                {"prescale_gradients": True, "sparse_gradients": True, "amp": {"enabled": True}}
            ),
            ValueError,
            r"3 keys cannot be honoured(.|\n)*prescale_gradients=True(.|\n)*sparse_gradients"
            r"=True(.|\n)*amp\.enabled=True",
        ),
        (
            "DeepSpeed parameter offload below stage 3",
            lambda: ZeroConfig.from_deepspeed(
                {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
            ),
            ValueError,
            r"offload_params='cpu' needs stage=3",
        ),
        (
            "DeepSpeed NVMe offload without a path",
            lambda: ZeroConfig.from_deepspeed(
                {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
            ),
            ValueError,
            r"needs offload_dir",
        ),
        (
            "bf16 and fp16",
            lambda: ZeroConfig.from_deepspeed(
                {"bf16": {"enabled": True}, "fp16": {"enabled": True}}
            ),
            ValueError,
            r"enable one of them",
        ),
        (
            "no trainable parameters",
            engine(frozen_model()),
            ValueError,
            r"Linear has no trainable parameters",
        ),
        (
            "requires_grad changed between steps",
            on_one_rank(freeze_between_steps),
            RuntimeError,
            r"parameter 0\.weight has requires_grad=False now",
        ),
        (
            "backward twice without step",
            on_one_rank(backward_twice),
            RuntimeError,
            r"backward called 2 times without step\(\)",
        ),
        (
            "optimizer not elementwise",
            on_one_rank(lbfgs),
            (TypeError, ValueError),  # type: ignore[list-item]
            r"LBFGS",
        ),
        (
            "meta model without values",
            on_one_rank(meta_without_values),
            ValueError,
            r"parameter weight is on the meta device: pass its values",
        ),
        (
            "unknown backend",
            lambda: zero_comm.init("tcp"),
            ValueError,
            r"backend='tcp' is not one of",
        ),
        (
            "zero timeout",
            lambda: zero_comm.init("gloo", timeout=0),
            ValueError,
            r"timeout must be a positive number of seconds, got 0",
        ),
        (
            "a heartbeat timeout of NaN",
            lambda: zero_comm.init("gloo", heartbeat_timeout=float("nan")),
            ValueError,
            r"heartbeat_timeout must be a positive number of seconds, got nan",
        ),
        (
            "nccl without a GPU",
            lambda: zero_comm.init("nccl"),
            BackendUnavailableError,
            r"needs CUDA.*use backend='gloo'",
        ),
        (
            "complex all_reduce",
            collective(lambda c: c.all_reduce(torch.zeros(2, dtype=torch.complex64))),
            TypeError,
            r"complex64",
        ),
        (
            "reduce_scatter sizes",
            collective(lambda c: c.reduce_scatter(torch.zeros(2), torch.zeros(3))),
            ValueError,
            r"reduce_scatter",
        ),
        (
            "broadcast from rank 5",
            collective(lambda c: c.broadcast(torch.zeros(2), src=5)),
            ValueError,
            r"src=5",
        ),
        (
            "heads do not divide width",
            lambda: GPTConfig(vocab_size=10, context=8, layers=1, heads=3, width=8),
            ValueError,
            r"heads=3",
        ),
        ("TP does not divide heads", lambda: check_tp_degree(2, 8, 256, 4), ValueError, r"heads=2"),
        (
            "data file missing",
            lambda: load_tokens(tmp / "nope.txt"),
            FileNotFoundError,
            r"nope\.txt: no such file or folder",
        ),
        (
            "data file empty",
            lambda: load_tokens(write(tmp, "empty.txt", b"")),
            ValueError,
            r"empty\.txt: empty",
        ),
        (
            "uint16 file of odd size",
            lambda: load_tokens(write(tmp, "odd.bin", b"abc")),
            ValueError,
            r"odd\.bin: a uint16 token file must have an even size",
        ),
        (
            "data shorter than the context",
            lambda: BatchSampler(
                torch.arange(3), context=16, global_batch=2, dp_rank=0, dp_size=1
            ).batch(0),
            ValueError,
            r"the data has 3 tokens; need more than 17",
        ),
        ("zero-train --tp 3 on 2 ranks", train_options("--tp", "3"), SystemExit, r""),
        ("zero-train --stage 7", train_options("--stage", "7"), SystemExit, r""),
        (
            "checkpoint of another vocabulary",
            load_into(ckpt, other_vocab),
            CheckpointError,
            r"another model: group 0 parameter 0 is wte\.weight \(256, 32\) there and "
            r"wte\.weight \(300, 32\)",
        ),
        (
            "checkpoint that is not there",
            load_into(tmp / "none", small),
            CheckpointError,
            r"no checkpoint at .*none",
        ),
    ]


def test_every_wrong_input_raises_its_documented_error(tmp_path: Path, capsys: Any) -> None:
    table = rows(tmp_path)
    assert len(table) >= 30
    failures = []
    for what, call, error, pattern in table:
        try:
            call()
        except error as exc:  # type: ignore[misc]
            if isinstance(exc, SystemExit):
                assert exc.code == 2, what
                continue
            if not re.search(pattern, str(exc)):
                failures.append(f"{what}: message {str(exc)!r} does not match {pattern!r}")
        except BaseException as exc:
            failures.append(f"{what}: raised {type(exc).__name__}: {exc}, not {error}")
        else:
            failures.append(f"{what}: raised nothing")
    assert not failures, "\n".join(failures)
    err = capsys.readouterr().err
    assert "--tp 3 does not divide the 2 ranks" in err and "--stage 7" in err


@pytest.mark.parametrize("stage", [0, 3])
def test_a_nan_policy_of_raise_names_the_parameter(stage: int) -> None:
    """The documented FloatingPointError for a NaN gradient with nonfinite='raise'."""

    def body(comm: Communicator) -> None:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        e = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 ZeroConfig(stage=stage, nonfinite="raise",
                                            persistence_threshold=0), comm)  # fmt: skip
        e.backward(e(torch.tensor([[float("nan"), 1.0]])).sum())
        e.step()

    with pytest.raises(FloatingPointError, match=r"parameter 0\.weight is NaN or Inf"):
        on_one_rank(body)()


def zero_train(*argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``zero-train ARGV`` run by hand (it starts its own ranks), as a user types it."""
    return subprocess.run([sys.executable, "-m", "zero_models.train", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "3"], "--batch-size 16 does not split over 3 data-parallel ranks; use a "
                           "multiple of 3 (e.g. --batch-size 18) or another --nproc"),
        (["--out", "a-file"], "--out a-file is a file; name a folder for the run's results"),
        (["--lr", "-1"], "--lr -1.0 must be a positive learning rate"),
        (["--heartbeat-timeout", "-5"], "--heartbeat-timeout -5.0 must be a number of seconds > 0"),
        (["--preempt-signals", "KILL"], "'KILL' is not a signal that can be caught"),
        (["--out", "used"], "--out used holds the results of another run (metrics.jsonl); "
                            "continue it with --resume auto, replace it with --overwrite"),
    ],
)  # fmt: skip
def test_zero_train_probes_end_in_one_line_not_a_traceback(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    result = zero_train(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("zero-train: error: ") and message in last, last


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: one checkpoint of the small GPT (about 10 MiB) fits, two do not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_names_the_intact_checkpoint(small_disk: Path) -> None:
    """The second save runs out of space: one line says so, names the checkpoint that is
    still intact, and the partial copy is gone; the intact one loads (resume goes on)."""
    out = small_disk / "run"
    common = ["--steps", "4", "--save-every", "2", "--sample-tokens", "1", "--threads", "1"]
    result = zero_train(*common, "--out", str(out), cwd=small_disk)
    assert result.returncode == 3, result.stderr[-3000:]  # EXIT_FAILED
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("zero-train: error: [rank 0] saving checkpoint "), last
    assert "No space left on device" in last
    assert f"the previous checkpoint {out / 'checkpoint' / 'global_step2'} is intact" in last
    assert not (out / "checkpoint" / "global_step4.saving").exists()
    assert (out / "checkpoint" / "latest").read_text().strip() == "global_step2"
    index = json.loads((out / "checkpoint" / "global_step2" / "index.json").read_text())
    assert index["extra"]["step"] == 2
