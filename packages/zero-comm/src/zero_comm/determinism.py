"""What the bits of a computation depend on: a process's *fingerprint*.

With ``zero_comm.init(deterministic=True)`` every reduction adds the ranks' contributions
in rank order, so the communication never changes a bit. The local arithmetic can: the
same matmul gives other bits with another BLAS, another vector unit, or (MKL on Intel)
another intra-op thread count. Bitwise promises therefore hold between two runs whose
fingerprints are equal; :func:`fingerprint_differences` names what differs otherwise.

    Fingerprint(torch="2.13.0+cpu", blas="MKL 2024.2", onednn="3.12.0",
                cpu_capability="AVX2", cpu="AMD EPYC", device="cpu",
                intra_op_threads=1, deterministic_algorithms=False)

The table of which operations depend on which of these, measured, is in
packages/zero-core/README.md ("The determinism contract").
"""

from __future__ import annotations

import functools
import os
import platform
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class Fingerprint(NamedTuple):
    """Everything, besides the inputs, that the bits of a training step depend on."""

    torch: str  # torch.__version__ (the build: "+cpu", "+cu126")
    blas: str  # the BLAS torch was built with, its version, and CODE_PATH_VARIABLES set
    onednn: str  # oneDNN (MKL-DNN) version, "none" if absent
    cpu_capability: str  # the vector ISA torch's kernels use: "AVX2", "AVX512", "DEFAULT"
    cpu: str  # the CPU model: MKL dispatches its kernels by vendor and model
    device: str  # "cpu", or the CUDA device's name and the CUDA / cuDNN versions
    intra_op_threads: int  # torch.get_num_threads() of the process
    deterministic_algorithms: bool  # torch.are_deterministic_algorithms_enabled()

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


@functools.lru_cache(maxsize=1)
def _build_info() -> tuple[str, str]:
    """(blas, onednn) from torch's build configuration."""
    shown = torch.__config__.show()
    blas = "unknown"
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)", shown)
    blas_info = re.search(r"BLAS_INFO=(\w+)", shown)
    if mkl:
        blas = f"MKL {mkl.group(1)}"
    elif blas_info:
        blas = blas_info.group(1)
    onednn = re.search(r"MKL-DNN v(\S+)", shown)
    return blas, onednn.group(1) if onednn else "none"


# Variables that choose another code path inside the BLAS or oneDNN for the same CPU; a
# fingerprint names those that are set. (ATEN_CPU_CAPABILITY shows in cpu_capability.)
CODE_PATH_VARIABLES = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def _code_path_settings() -> str:
    found = [f"{name}={os.environ[name]}" for name in CODE_PATH_VARIABLES if name in os.environ]
    return f" ({', '.join(found)})" if found else ""


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else the platform's processor)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _device_description(device: torch.device | None) -> str:
    if device is None or device.type != "cuda":
        return "cpu"
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]  # None if absent
    return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, cuDNN {cudnn}"


def current_fingerprint(device: torch.device | None = None) -> Fingerprint:
    """This process's fingerprint now (the thread count is read at the call)."""
    blas, onednn = _build_info()
    return Fingerprint(
        torch=torch.__version__,
        blas=blas + _code_path_settings(),
        onednn=onednn,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu=cpu_model(),
        device=_device_description(device),
        intra_op_threads=torch.get_num_threads(),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
    )


_WHAT = {
    "torch": "torch",
    "blas": "BLAS",
    "onednn": "oneDNN",
    "cpu_capability": "CPU capability",
    "cpu": "CPU",
    "device": "device",
    "intra_op_threads": "threads per rank",
    "deterministic_algorithms": "torch.use_deterministic_algorithms",
}


class FingerprintDifference(NamedTuple):
    """One field on which two fingerprints differ: ``what`` names it for people."""

    field: str
    what: str
    before: Any
    now: Any


def fingerprint_differences(
    before: Mapping[str, Any] | Fingerprint, now: Mapping[str, Any] | Fingerprint
) -> list[FingerprintDifference]:
    """Each field that differs, in field order; [] when the two agree.

    A field missing from ``before`` (an older record) counts as a difference."""
    old = before._asdict() if isinstance(before, Fingerprint) else dict(before)
    new = now._asdict() if isinstance(now, Fingerprint) else dict(now)
    return [
        FingerprintDifference(key, _WHAT.get(key, key), old.get(key, "not recorded"), new[key])
        for key in new
        if old.get(key) != new[key]
    ]
