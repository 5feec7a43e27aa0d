"""Catch tensors our packages make without naming a device.

On a GPU every buffer the engine makes must be on the communicator's device (or, for host
offload and checkpoint files, explicitly on the CPU). A factory call with no ``device``
makes a CPU tensor, which on CPU test machines is the right device by accident: the bug
shows only on a GPU (``all_gather: output is on cpu``). :class:`ImplicitDeviceCalls` is a
torch function mode that records every such call made from a file of ``zero_comm``,
``zero_core`` or ``zero_models``, so a CPU test finds them.

Torch function modes are per thread: enter it inside each simulated rank's body.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange,
    torch.rand, torch.randn, torch.randint, torch.empty_strided, torch.linspace, torch.eye,
    torch.as_tensor,
}  # fmt: skip
PACKAGES = ("zero_comm", "zero_core", "zero_models")


def _caller() -> str:
    """'file:line' of the code that called the factory: the nearest frame outside this
    module and torch's dispatch (a call made inside torch, by ``nn.Linear`` say, is
    torch's, not ours)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith((f"{__name__}.py", "torch/overrides.py", "torch/utils/_device.py")):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class ImplicitDeviceCalls(TorchFunctionMode):
    """Records ``calls``: the 'file:line' of each factory call without ``device`` made
    from one of our packages (a set: each site once)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            site = _caller()
            if any(f"/{package}/" in site for package in PACKAGES):
                self.calls.add(site)
        return func(*args, **kwargs)
