"""Stepping an optimizer over part of its tensors at a time, bit for bit as one step.

The masters can step their tiles bucket by bucket, so that the parameters start gathering
a bucket while the next one is stepped (replicated_params):

    one call     set .grad of t0 t1 t2 -> optimizer.step() -> gather b0 b1 b2
    in parts     t0 -> step -> gather b0 (async)
                       t1 -> step -> gather b1 (async)
                                t2 -> step -> gather b2 (async) -> wait for all

This is exact for the optimizers of ``IN_PARTS`` (torch's SGD, Adam, AdamW, Adagrad,
RMSprop): their ``step()`` skips a tensor whose ``.grad`` is None, and updates each
tensor from that tensor, its gradient, its own state (moments, buffers, its own ``step``
counter) and its group's options only. So each part's call gives the tensors it steps
the bits one call over all of them gives, with whichever implementation runs (for-loop,
foreach, fused: docs/benchmarks/cpu-optimizer.md measured each against its per-tile
form) provided both choose the same one; torch chooses from the devices of the tensors
stepped in each group, so the tensors of a call must all be on one device (the masters'
tiles are). Their state is created in the same order (group, then tile), so the
optimizer's ``state_dict()`` is the same too.

Any other optimizer (a subclass, a third-party class) might read every tensor in one
step (a global norm, a shared counter), and step hooks would run once per part and see
the model half stepped: those are stepped in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import optimizer as torch_optimizer

from zero_comm.profiler_ranges import profiler_range

# Exact types: a subclass may override step().
IN_PARTS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)


def steps_in_parts(optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer`` may be stepped a part of its tensors at a time, each part
    getting the bits one step of all of them gives (see the module docstring)."""
    if type(optimizer) not in IN_PARTS:
        return False
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    return not any(hooks)


def step_part(
    optimizer: torch.optim.Optimizer, part: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """One ``optimizer.step()`` over the tensors of ``part`` only, each given its
    gradient (``(tensor, gradient)`` pairs); every other tensor of the optimizer must
    have ``.grad`` None. The gradients are cleared again, also when the step raises."""
    for tensor, gradient in part:
        tensor.grad = gradient
    try:
        with profiler_range("optimizer_step"):
            optimizer.step()
    finally:
        for tensor, _ in part:
            tensor.grad = None
