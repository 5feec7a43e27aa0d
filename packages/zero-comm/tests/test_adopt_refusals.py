"""What zero_comm.from_process_group and init refuse, and what they adopt, in one process
(a world of one, in a subprocess of its own so this test process never initialises
torch.distributed): each mistake raises naming the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import zero_comm
from zero_comm.adopt import from_process_group

ONE_RANK = r"""
import json, logging, io
import torch.distributed as dist
import zero_comm

said = io.StringIO()
logging.basicConfig(stream=said, level=logging.INFO, format="%(message)s")
out = {}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
comm = zero_comm.from_process_group(deterministic=False, timeout=7.0)
out["adopted"] = [comm.rank, comm.world_size, comm.backend, comm.deterministic, comm.timeout]
try:
    zero_comm.init("nccl")
except zero_comm.BackendUnavailableError as exc:
    out["wrong_backend"] = str(exc)
again = zero_comm.init(timeout=9.0)
out["init"] = [again.world_size, again.deterministic, again.timeout]
again.close()
comm.close()
out["still_initialised"] = dist.is_initialized()
dist.destroy_process_group()
out["log"] = said.getvalue()
print(json.dumps(out))
"""


def test_without_an_initialised_group_it_names_init_process_group() -> None:
    with pytest.raises(zero_comm.BackendUnavailableError, match="init_process_group"):
        from_process_group()


def test_an_mpi4py_communicator_is_sent_to_from_mpi_comm() -> None:
    class Intracomm:  # stands for mpi4py's, without starting MPI in this process
        __module__ = "mpi4py.MPI"

    with pytest.raises(TypeError, match=r"zero_comm\.from_mpi_comm"):
        from_process_group(Intracomm())


@pytest.mark.timeout(120)
def test_a_world_of_one_is_adopted_with_the_options_given() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ONE_RANK], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["adopted"] == [0, 1, "gloo", False, 7.0]
    assert "backend is 'gloo', not 'nccl'" in out["wrong_backend"]
    assert "backend='auto'" in out["wrong_backend"]
    assert out["init"] == [1, False, 9.0]  # init's own options (its default: not deterministic)
    assert out["still_initialised"], "closing an adopted communicator destroyed the group"
    assert "adopting its default group instead of creating a world" in out["log"]


class FakeGroup:
    """Stands for a process group: backend_of reads only torch's records of it."""


@pytest.mark.parametrize(
    ("name", "config", "cuda", "wanted", "chosen"),
    [
        ("gloo", "cpu:gloo,cuda:gloo", False, "auto", "gloo"),
        ("undefined", "cpu:gloo,cuda:nccl", False, "auto", "gloo"),  # no backend named, CPU
        ("undefined", "cpu:gloo,cuda:nccl", True, "auto", "nccl"),
        ("undefined", "cpu:gloo,cuda:nccl", True, "gloo", "gloo"),  # its CPU half, asked for
        ("gloo", "cpu:gloo,cuda:gloo", True, "nccl", None),
        ("ucc", "cpu:ucc,cuda:ucc", True, "auto", None),
        ("mpi", "cpu:mpi", False, "auto", None),
    ],
)
def test_the_backend_driven_is_gloo_or_nccl_else_it_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    config: str,
    cuda: bool,
    wanted: str,
    chosen: str | None,
) -> None:
    import torch
    import torch.distributed as dist

    from zero_comm.adopt import backend_of

    group = FakeGroup()
    monkeypatch.setattr(dist, "get_backend", lambda g: name)
    monkeypatch.setitem(dist.distributed_c10d._world.pg_backend_config, group, config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if chosen is not None:
        assert backend_of(group, 0, wanted) == chosen
        return
    with pytest.raises(zero_comm.BackendUnavailableError) as err:
        backend_of(group, 3, wanted)
    said = str(err.value)
    assert "[rank 3]" in said
    if wanted == "auto":
        assert "supports gloo and nccl" in said and "from_mpi_comm" in said, said
    else:
        assert f"not {wanted!r}" in said and "backend='auto'" in said, said


def test_nccl_without_a_gpu_names_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from zero_comm.adopt import _device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(zero_comm.BackendUnavailableError, match="gloo backend on CPU"):
        _device_for("nccl", FakeGroup())
