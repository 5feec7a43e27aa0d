"""The framework paths on one CUDA GPU (a world of 1, one process): zero_comm adopting a
torch.distributed group that someone else made on NCCL, and Lightning's ZeroStrategy on
CUDA. Run by tools/gpu/check.sh after cuda_engine_body.py (under a minute on a GPU); with
``--allow-cpu`` the same checks run on gloo and the CPU (tests/test_gpu_check.py).

Each part prints one line, ``PASS <part>: ...`` or ``FAIL <part>: ...`` (after the
traceback); the exit status is 1 when any part failed, 0 otherwise:

  adopt      init_process_group("nccl") from variables set here (127.0.0.1, a free port,
             RANK=0, WORLD_SIZE=1), then zero_comm.from_process_group(): the device is
             CUDA, all_reduce / reduce_scatter / all_gather give the sums and chunks
             expected, and stage 3 trains 3 steps (bf16, tied embedding, accumulation,
             clipping) to stage 0's bits on the adopted communicator;
  init       the group destroyed, zero_comm.init("nccl") makes a world of its own: the same
             stage-3 run gives the adopted group's bits, and close() takes its group away;
  auto       init_process_group() with no backend name ("cpu:gloo,cuda:nccl"), adopted with
             backend="auto": zero_comm drives its nccl side (gloo where torch has no CUDA);
  lightning  Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=4)
             with ZeroStrategy(stage=3) fits, and its float32 weights equal stage 0's bit
             for bit (``SKIP lightning: ...`` with the reason where lightning is not
             installed: it is zero-core's optional extra [lightning]).

The parts share the process one after another, so each leaves no process group behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from parity import ParityCase, assert_same_states, build_engine, normalised, run_steps

import zero_comm
from zero_comm import Communicator

CASE = ParityCase(
    vocab=11,
    tie=True,
    dtype="bfloat16",
    clip=0.5,
    accumulation=2,
    bucket_numel=64,
    persistence_threshold=0,
    steps=3,
)
LIGHTNING_RUNS = Path(__file__).parent / "lightning_strategy" / "lightning_runs.py"


class Target:
    """Where the checks run: CUDA and nccl, or (``--allow-cpu``) the CPU and gloo."""

    def __init__(self, allow_cpu: bool) -> None:
        self.cuda = torch.cuda.is_available()
        if not self.cuda and not allow_cpu:
            raise SystemExit(
                "cuda_integrations_body.py: FAILED: no CUDA device is visible to torch; "
                "run it on a GPU machine, or with --allow-cpu to try it on gloo and the CPU"
            )
        self.device_type = "cuda" if self.cuda else "cpu"
        self.backend = "nccl" if self.cuda else "gloo"


def set_world_of_one() -> None:
    """The variables a launcher would set for one process, on a port free just now (a
    port of the part before may still be closing)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.pop("LOCAL_RANK", None)


def collectives_give_expected(comm: Communicator) -> None:
    """all_reduce, reduce_scatter and all_gather on small exact values (sums of
    integers and quarters, so any summation order gives the same bits): rank r sends
    (r + 1) * base, and the results are what that makes for ``comm.world_size`` ranks."""
    n, rank = comm.world_size, comm.rank
    base = torch.arange(12, dtype=torch.float32, device=comm.device) + 0.25
    ranks_sum = n * (n + 1) // 2  # sum of (r + 1) over the ranks
    reduced = base * (rank + 1)
    comm.all_reduce(reduced)
    assert torch.equal(reduced, base * ranks_sum), f"all_reduce gave {reduced.tolist()}"
    chunks = torch.cat([base * (rank + 1) + 100 * c for c in range(n)])  # chunk c for rank c
    mine = torch.empty_like(base)
    comm.reduce_scatter(mine, chunks)
    expected = base * ranks_sum + 100 * rank * n
    assert torch.equal(mine, expected), f"reduce_scatter gave {mine.tolist()}"
    gathered = torch.empty(n * base.numel(), dtype=base.dtype, device=comm.device)
    comm.all_gather(gathered, base * (rank + 1))
    assert torch.equal(gathered, torch.cat([base * (r + 1) for r in range(n)])), (
        f"all_gather gave {gathered.tolist()}"
    )


def stage3_states(comm: Communicator) -> list[dict[str, torch.Tensor]]:
    case = normalised(CASE)
    return run_steps(build_engine(case, comm, 3), case, comm, range(case.steps))


def adopted(target: Target, states: dict[str, list[dict[str, torch.Tensor]]]) -> str:
    """The part adopt; returns its PASS line and keeps its stage-3 states in ``states``."""
    set_world_of_one()
    dist.init_process_group(target.backend)
    comm = zero_comm.from_process_group()
    assert comm.device.type == target.device_type, f"adopted on {comm.device}"
    assert comm.backend == target.backend, f"adopted as {comm.backend}"
    collectives_give_expected(comm)
    case = normalised(CASE)
    stage0 = run_steps(build_engine(case, comm, 0), case, comm, range(case.steps))
    states["adopted"] = stage3_states(comm)
    assert_same_states(stage0, states["adopted"], f"stage 3 on the adopted {target.backend} group")
    comm.close()
    assert dist.is_initialized(), "closing an adopted communicator destroyed the group"
    dist.destroy_process_group()
    return (
        f"adopt: from_process_group() over init_process_group({target.backend!r}) on "
        f"{comm.device}: collectives exact, stage 3 == stage 0 bit for bit ({case.steps} steps)"
    )


def made_by_init(target: Target, states: dict[str, list[dict[str, torch.Tensor]]]) -> str:
    """The part init (after adopt, whose stage-3 states it compares with); its PASS line."""
    if "adopted" not in states:
        raise RuntimeError("not run: the part adopt failed, and its states are the reference")
    set_world_of_one()
    comm = zero_comm.init(target.backend, deterministic=True)
    assert comm.device.type == target.device_type, f"init made {comm.device}"
    assert comm.backend == target.backend, f"init made {comm.backend}"
    assert_same_states(
        states["adopted"], stage3_states(comm), f"stage 3 on zero_comm.init({target.backend})"
    )
    comm.close()
    assert not dist.is_initialized(), "zero_comm.init's world outlived close()"
    return (
        f"init: stage 3 on zero_comm.init({target.backend!r}) == stage 3 on the adopted "
        "group bit for bit"
    )


def auto_picks_the_device_backend(target: Target) -> str:
    """The part auto; returns its PASS line."""
    set_world_of_one()
    dist.init_process_group()  # no backend name: one backend per device type
    comm = zero_comm.from_process_group(backend="auto")
    assert comm.backend == target.backend, (
        f"backend='auto' drove {comm.backend} of {dist.get_backend_config()!r}"
    )
    assert comm.device.type == target.device_type, f"adopted on {comm.device}"
    collectives_give_expected(comm)
    comm.close()
    config = dist.get_backend_config()
    dist.destroy_process_group()
    drives = target.backend
    return f"auto: init_process_group() ({config}) adopted with backend='auto' drives {drives}"


def lightning_stage3_equals_stage0(target: Target) -> str:
    """The part lightning; returns its PASS line (its caller checks lightning imports)."""
    spec = importlib.util.spec_from_file_location("lightning_runs", LIGHTNING_RUNS)
    assert spec is not None and spec.loader is not None
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    from zero_core.lightning import ZeroStrategy

    set_world_of_one()  # Lightning's own environment reads these
    options = {
        "accelerator": target.device_type,
        "devices": 1,
        "precision": "bf16-mixed",
        "max_steps": 4,
    }
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        results = {}
        for stage in (3, 0):
            trainer = runs.fit(out, f"zero{stage}", ZeroStrategy(stage=stage), **options)
            assert trainer.global_step == 4, f"stage {stage} stopped at {trainer.global_step}"
            engine = trainer.strategy.engine
            assert engine.comm.device.type == target.device_type, engine.comm.device
            results[stage] = torch.load(out / f"zero{stage}.pt")
    if dist.is_initialized():  # Lightning's group: the parts after this one start clean
        dist.destroy_process_group()
    expected, actual = results[0]["params"], results[3]["params"]
    assert expected.keys() == actual.keys(), f"{sorted(expected)} != {sorted(actual)}"
    for key in expected:
        assert actual[key].dtype == torch.float32, f"{key} is {actual[key].dtype}"
        assert torch.equal(expected[key], actual[key]), (
            f"{key}: stage 3 differs from stage 0 by up to "
            f"{(expected[key] - actual[key]).abs().max().item():.3g}"
        )
    return (
        f"lightning: Trainer(accelerator={target.device_type!r}, devices=1, "
        "precision='bf16-mixed', max_steps=4): ZeroStrategy(stage=3) == stage 0 bit for bit"
    )


def lightning_missing() -> str:
    """Why the part lightning cannot run here, or "" where Lightning imports."""
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError as exc:  # the optional extra is not installed
        return f"Lightning does not import ({exc}); it is zero-core's extra [lightning]"
    return ""


def run_part(name: str, part: Callable[[], str]) -> bool:
    """Run one part: its PASS line, or the traceback and its FAIL line. Any process
    group it left (after a failure) is destroyed, so the next part starts clean."""
    try:
        line = part()
    except Exception as exc:  # every failure is reported, and the next part still runs
        traceback.print_exc()
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return False
    print(f"PASS {line}", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without a GPU, run the same checks on gloo and the CPU (for testing)",
    )
    target = Target(parser.parse_args(argv).allow_cpu)
    states: dict[str, list[dict[str, torch.Tensor]]] = {}
    passed = run_part("adopt", lambda: adopted(target, states))
    passed &= run_part("init", lambda: made_by_init(target, states))
    passed &= run_part("auto", lambda: auto_picks_the_device_backend(target))
    missing = lightning_missing()
    if missing:
        print(f"SKIP lightning: {missing}", flush=True)
    else:
        passed &= run_part("lightning", lambda: lightning_stage3_equals_stage0(target))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
