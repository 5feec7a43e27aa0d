"""``get_accelerator()``: DeepSpeed's device abstraction, for the calls its examples make.

    from zero_core.deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(local_rank))

CUDA where torch sees a GPU, else the CPU (DeepSpeed's ``DS_ACCELERATOR=cpu``, except that
the communication backend here is gloo, not oneCCL). Calls it does not provide raise
naming themselves.
"""

from .device import CpuAccelerator, CudaAccelerator, DeviceAccelerator, get_accelerator

__all__ = ["CpuAccelerator", "CudaAccelerator", "DeviceAccelerator", "get_accelerator"]
