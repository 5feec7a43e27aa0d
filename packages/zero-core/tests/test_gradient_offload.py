"""The gradient tier (ZeroConfig.offload_gradients): reduced gradient slices leave the device
for host memory or swap files as they land; the device keeps only the in-flight bound; the
bits stay those of the device path; a torn or stale gradient block is never stepped on.

The parity with stage 0 over drawn cases (accumulation, clipping, reduce dtype, tiers,
fraction, world sizes 1-4) is test_offload.py's hypothesis test; here are the fixed cases
every run checks, the memory figures and the failure modes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import (
    ParityCase,
    build_engine,
    normalised,
    run_steps,
    tiers_equal_stage0,
)

import zero_core
from zero_comm import Communicator, run_simulated
from zero_core.component_access import disk_swap, reduce_scattered_gradients
from zero_core.offload.gradient_tier import HostSlice, SwappedSlice
from zero_core.reduced_gradient import Scale, ShardGradient, scale_like_device

CASE = ParityCase(widths=(5, 130, 7), vocab=11, tie=True, two_groups=True, optimizer="adamw",
                  dtype="bfloat16", bucket_numel=300, persistence_threshold=0,
                  sub_group_numel=64)  # fmt: skip


def with_tiers(optimizer: str, params: str = "none", **more: object) -> ParityCase:
    tiers = {"offload_optimizer": optimizer, "offload_params": params, **more}
    return normalised(ParityCase(**{**CASE.__dict__, **tiers}))


@pytest.mark.parametrize("optimizer", ["cpu", "disk"])
@pytest.mark.parametrize(
    ("accumulation", "clip", "reduce_dtype"),
    [(1, None, None), (3, 0.05, None), (2, 0.05, "float32")],
)
def test_offloaded_gradients_equal_stage_0_bit_for_bit(
    optimizer: str, accumulation: int, clip: float | None, reduce_dtype: str | None
) -> None:
    """Stages 1-3, gradients in host memory or on disk (parameters on disk at stage 3),
    accumulated and clipped, equal stage 0 without offload on 2 ranks (torch.equal)."""
    case = with_tiers(
        optimizer, "disk", accumulation=accumulation, clip=clip, reduce_dtype=reduce_dtype
    )
    run_simulated(2, lambda comm: tiers_equal_stage0(comm, case))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("optimizer", ["cpu", "disk"])
def test_device_gradient_bytes_drop_to_the_in_flight_bound(stage: int, optimizer: str) -> None:
    """With every tile offloaded, every bucket's slice leaves the device: the report counts
    the gradient shard under host (cpu) or disk (disk) instead of ``gradients``, and
    ``gradients`` is only the landed bound; the device never held more landed slices
    than that during backward (measured at every landing)."""

    def body(comm: Communicator) -> tuple[zero_core.MemoryReport, zero_core.MemoryReport]:
        reports = []
        for offload in (False, True):
            case = with_tiers(optimizer, accumulation=2, offload_gradients=offload)
            engine = build_engine(case, comm, stage)
            gradients = reduce_scattered_gradients(engine)
            tier = gradients.tier
            assert (tier is not None) == offload
            if tier is not None:
                assert len(tier.homes) == len(list(gradients.buckets)), "every slice leaves"
                tier.track_peak = True
            run_steps(engine, case, comm, range(2))
            report = engine.memory_report()
            if tier is not None:
                assert 0 < tier.peak_held <= tier.landed_bytes
                assert report.gradients == tier.landed_bytes
                assert report.gradients_in_flight == 3 * tier.landed_bytes  # in flight: 2
            reports.append(report)
            engine.close()
        return reports[0], reports[1]

    for plain, offloaded in run_simulated(2, body):
        shard = plain.gradients  # the whole bf16 gradient shard, on the device
        assert plain.gradients_in_flight == 0
        assert offloaded.gradients < shard
        if optimizer == "cpu":
            assert offloaded.host - plain.host == shard
            assert offloaded.disk == plain.disk == 0
        else:
            assert offloaded.disk - plain.disk == shard  # one gradient block per tile
            # the pipeline's gradient buffers, each at most one tile of bf16
            assert 0 < offloaded.host - plain.host <= 4 * CASE.sub_group_numel * 2


def test_the_bucket_split_by_offload_fraction_keeps_the_device_path() -> None:
    """offload_fraction 0.5: buckets whose tiles are all offloaded leave the device, the
    others (and the one the cut splits) stay; the bits still equal stage 0."""
    case = with_tiers("cpu", offload_fraction=0.5)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        gradients = reduce_scattered_gradients(engine)
        assert gradients.tier is not None
        buckets = list(gradients.buckets)
        assert 0 < len(gradients.tier.homes) < len(buckets)
        for bucket in buckets:
            assert bucket.drained == (bucket.position in gradients.tier.homes)
        engine.close()
        tiers_equal_stage0(comm, case)

    run_simulated(2, body)


def test_stage_1_keeps_its_gradients_on_the_device() -> None:
    """Stage 1's full gradient buckets stay on the device: offloading the reduced slice
    would save 1/N of them; the gradients do not follow the tier there."""

    def body(comm: Communicator) -> None:
        engine = build_engine(with_tiers("cpu", accumulation=2), comm, 1)
        assert reduce_scattered_gradients(engine).tier is None
        assert engine.memory_report().gradients_in_flight == 0
        engine.close()

    run_simulated(2, body)


def test_a_corrupt_gradient_block_is_named_not_consumed() -> None:
    """A gradient block changed between backward and step fails its checksum when the
    step's pipeline reads it: CorruptSwapError names the file, and no master changed."""
    case = with_tiers("disk")

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        run_steps(engine, case, comm, range(1))
        tokens = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(5))
        engine.backward(engine(tokens).float().square().mean())
        victim = sorted(disk_swap(engine).folder.glob("*.gradient.swap"))[-1]
        with open(victim, "r+b") as file:
            byte = file.read(1)
            file.seek(0)
            file.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(zero_core.CorruptSwapError, match=victim.name):
            engine.step()
        engine.close()

    run_simulated(1, body)


def test_a_gradient_slice_is_never_read_before_it_landed_or_after_the_step() -> None:
    """A host or disk slice refuses a read when this step's gradient has not landed in it
    (never a stale one from the last step)."""
    case = with_tiers("disk", accumulation=2)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 2)
        tier = reduce_scattered_gradients(engine).tier
        assert tier is not None
        homes = list(tier.homes.values())
        assert all(isinstance(home, SwappedSlice) for home in homes)
        with pytest.raises(RuntimeError, match="before this step's gradient landed"):
            homes[0].read(0, 1)
        run_steps(engine, case, comm, range(1))
        with pytest.raises(RuntimeError, match="before this step's gradient landed"):
            homes[0].read(0, 1)
        assert not any(disk_swap(engine).gradient_landed)
        engine.close()

    run_simulated(1, body)
    host = HostSlice(4, torch.float32, torch.device("cpu"), pin=False)
    host.land(torch.ones(4), first=True)
    host.land(torch.ones(4), first=False)
    assert torch.equal(host.read(0, 4), torch.full((4,), 2.0))
    host.release()
    with pytest.raises(RuntimeError, match="landed"):
        host.read(0, 4)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=1, max_size=40),
    denominator=st.floats(1.0, 1e6),
    coefficient=st.floats(1e-6, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_an_away_slice_reads_back_with_the_resident_pieces_bits(
    values: list[float], denominator: float, coefficient: float, dtype: torch.dtype
) -> None:
    """The step's scaling replayed on a read (float32 copy, divide, multiply) gives the
    bits the in-place scaling of a resident piece gives (on this machine's device)."""
    raw = torch.tensor(values).to(dtype)
    resident = ShardGradient([raw.clone()], [0]).float()
    resident.div_(denominator)
    resident.mul_(coefficient)
    away = ShardGradient([raw.clone()], [0], away={0: _Held(raw)})
    away = away.float()
    away.scale_away("div", denominator)
    away.mul_(coefficient)
    assert torch.equal(away[0 : raw.numel()], resident[0 : raw.numel()])


def test_the_cuda_division_is_a_multiplication_by_the_float32_reciprocal() -> None:
    """A slice read on the host for a CUDA run divides as CUDA does (a * (1 / b), the
    reciprocal rounded to float32), which differs from the division for some values."""
    values = torch.arange(1, 2001, dtype=torch.float32) * 0.37
    divided, like_cuda = values.clone(), values.clone()
    scale_like_device(divided, Scale("div", 3.0, "cpu"))
    scale_like_device(like_cuda, Scale("div", 3.0, "cuda"))
    reciprocal = float(torch.tensor(1.0) / torch.tensor(3.0))
    assert torch.equal(divided, values / 3.0)
    assert torch.equal(like_cuda, values * reciprocal)
    assert not torch.equal(divided, like_cuda)  # so the distinction matters


class _Held:
    """An away slice over a tensor (what HostSlice is, without the landing)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    @property
    def landed(self) -> bool:
        return True

    def read(self, start: int, stop: int) -> torch.Tensor:
        return self.values[start:stop]


def test_offload_gradients_is_validated() -> None:
    with pytest.raises(ValueError, match="offload_gradients='yes' must be True or False"):
        zero_core.ZeroConfig(offload_gradients="yes")  # type: ignore[arg-type]
    assert zero_core.ZeroConfig(offload_optimizer="cpu").gradients_offloaded
    assert not zero_core.ZeroConfig(stage=1, offload_optimizer="cpu").gradients_offloaded
    kept = zero_core.ZeroConfig(offload_optimizer="cpu", offload_gradients=False)
    assert not kept.gradients_offloaded
    assert not zero_core.ZeroConfig(offload_gradients=True).gradients_offloaded  # no tier
