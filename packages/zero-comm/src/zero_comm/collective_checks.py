"""The argument checks every collective of a :class:`~zero_comm.communicator.Communicator`
runs before any data moves: each raises TypeError or ValueError, prefixed ``[rank r]``,
naming the collective, the argument, what was seen and the fix.

    _check_tensor(name, role, t)     a torch.Tensor, a supported dtype, on the
                                     communicator's device type, contiguous
    _check_src(name, src)            a rank of this group
    _check_op(name, op, dtype)       a zero_comm.ReduceOp; AVG only of floating dtypes
    _check_pair(name, out, inp, ..)  both tensors checked, one dtype, and sizes that fit
                                     out_factor / in_factor chunks of world_size

Collectives call them inside ``describe`` (Communicator._enter), so with a consistency
check a rank whose arguments are bad still joins the agreement and the others name it.
:class:`CollectiveChecks` is a base of Communicator, as call_check.CallCheck is.
"""

from __future__ import annotations

import torch

from .call_check import DTYPE_CODE, SUPPORTED_DTYPES
from .reduce_op import ReduceOp


class CollectiveChecks:
    """Checks of one rank's arguments to a collective (no communication)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    def _err(self, message: str) -> str:
        return f"[rank {self.rank}] {message}"

    def _check_tensor(self, name: str, role: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(self._err(f"{name}: {role} must be a torch.Tensor, got {type(tensor)}"))
        if tensor.dtype not in DTYPE_CODE:
            supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(
                self._err(f"{name}: {role} has dtype {tensor.dtype}; supported: {supported}")
            )
        if tensor.device.type != self.device.type:
            raise ValueError(
                self._err(
                    f"{name}: {role} is on {tensor.device} but this {self.backend} communicator "
                    f"works on {self.device}; move it with .to({str(self.device)!r})"
                )
            )
        if not tensor.is_contiguous():
            raise ValueError(
                self._err(f"{name}: {role} must be contiguous; pass tensor.contiguous()")
            )

    def _check_src(self, name: str, src: int) -> int:
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(
                self._err(
                    f"{name}: src={src!r} is not a rank of this group (0..{self.world_size - 1})"
                )
            )
        return src

    def _check_op(self, name: str, op: ReduceOp, dtype: torch.dtype) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(self._err(f"{name}: op must be a zero_comm.ReduceOp, got {op!r}"))
        if op is ReduceOp.AVG and not dtype.is_floating_point:
            raise TypeError(
                self._err(f"{name}: AVG of {dtype} would truncate; use SUM and divide yourself")
            )

    def _check_pair(
        self, name: str, out: torch.Tensor, inp: torch.Tensor, out_factor: int, in_factor: int
    ) -> None:
        self._check_tensor(name, "output", out)
        self._check_tensor(name, "input", inp)
        if out.dtype != inp.dtype:
            raise TypeError(
                self._err(
                    f"{name}: output is {out.dtype} but input is {inp.dtype}; they must match"
                )
            )
        if in_factor > 1 and inp.numel() % in_factor:
            raise ValueError(
                self._err(
                    f"{name}: the input's {inp.numel()} elements do not split into "
                    f"world_size={in_factor} equal chunks; pad it to a multiple of {in_factor}"
                )
            )
        if out.numel() * in_factor != inp.numel() * out_factor:
            raise ValueError(
                self._err(
                    f"{name}: with world_size={self.world_size} the output must hold "
                    f"{inp.numel() * out_factor // in_factor} elements for an input of "
                    f"{inp.numel()}, got {out.numel()}"
                )
            )
