"""The two accelerators: CUDA and CPU, with DeepSpeed's method names."""

from __future__ import annotations

import os
from typing import Any

import torch

from ...memory.proc_status import process_status_kib
from ..unsupported import unsupported


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class DeviceAccelerator:
    """What both accelerators share; ``__getattr__`` refuses the calls neither provides."""

    _name = ""
    _backend = ""

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cpu"``, or ``"cuda:<i>"`` with an index (the CPU has none)."""
        return self._name

    def communication_backend_name(self) -> str:
        """The zero_comm backend this device trains over ("nccl" or "gloo")."""
        return self._backend

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise unsupported(
            f"get_accelerator().{name}",
            "the facade's accelerator has device_name, current_device_name, current_device, "
            "set_device, is_available, device_count, communication_backend_name, "
            "is_bf16_supported, is_fp16_supported, manual_seed, synchronize, empty_cache and "
            "memory_allocated; call torch directly",
        )


class CudaAccelerator(DeviceAccelerator):
    """DeepSpeed's CUDA accelerator: torch.cuda underneath, NCCL for communication."""

    _name = "cuda"
    _backend = "nccl"

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        return int(torch.cuda.current_device())

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        return int(torch.cuda.device_count())

    def is_bf16_supported(self) -> bool:
        return bool(torch.cuda.is_bf16_supported())

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.cuda.memory_allocated(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.cuda.max_memory_allocated(device_index))


class CpuAccelerator(DeviceAccelerator):
    """DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), communicating over gloo.

    As DeepSpeed's: device names carry no index; the current device is the rank's
    LOCAL_RANK; the device count is the ranks on this node (LOCAL_WORLD_SIZE, else 1)."""

    _name = "cpu"
    _backend = "gloo"

    def current_device(self) -> int:
        return _local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        return None  # one CPU: nothing to select

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def synchronize(self, device_index: int | None = None) -> None:
        return None  # CPU work is done when the call returns

    def empty_cache(self) -> None:
        return None  # no caching allocator on the CPU

    def memory_allocated(self, device_index: int | None = None) -> int:
        """This process's resident bytes, as DeepSpeed's CPU accelerator reports."""
        return _status_bytes("VmRSS")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """This process's peak resident bytes."""
        return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    kib = process_status_kib(field)
    if kib is None:
        raise unsupported(f"memory statistics without /proc/self/status ({field})")
    return kib * 1024


def get_accelerator() -> DeviceAccelerator:
    """CUDA if torch sees a GPU, else the CPU."""
    return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
