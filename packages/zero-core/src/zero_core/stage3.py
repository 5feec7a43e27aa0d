"""Stage 3 (P_os+g+p): parameters partitioned too, gathered module by module just in time.

16 elements on N = 4 ranks (one bucket, 4 elements per shard):

    parameter shard (compute dtype)   rank 0 | p p p p |  rank 1 | p p p p |  ...
    gradient shard                    rank 0 | g g g g |  rank 1 | g g g g |  ...
    master + optimizer states         rank 0 | m m m m |  rank 1 | m m m m |  ...
    full parameters                   only while a module that uses them runs

Parameters are grouped into fetch units (fetch_units: one per module, tied weights with
their first module, small parameters in one persistent unit) and laid out in buckets that
never span two units. A forward pre-hook on each module gathers its units (param_gatherer:
prefetching the next ones along the order recorded on the first step) and a forward hook
frees them; a hook on the module's outputs gathers them again when backward reaches the
module, and they are freed once every one of their gradients has been reduce-scattered
(stage 2's bucket reducer, units in reverse registration order).

Memory per rank (mixed precision Adam, K = 12): (2 + 2 + K)Ψ/N plus alignment padding,
plus the persistent parameters (whole), plus the gathered working set: the units of the
modules running now and the prefetched ones, at most ``max_live_numel`` elements beyond
what the running modules need.
Communication per step: all-gather Ψ in forward, again in backward, reduce-scatter Ψ:
3Ψ (N-1)/N (the persistent unit instead: reduce-scatter, then all-gather after the step),
less the units forward keeps gathered for backward's start (``keep_backward_head``: they
are gathered once, not twice).
A tied weight used by two modules is gathered for each of them.

Frozen parameters stay whole on every rank.

Components (engine.Engine): reduce_scattered_gradients (sharded, by hooks),
sharded_params (fetch_units, param_gatherer), master_weights; this module wires the
model's module hooks to the gatherer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .param_gatherer import Pass
from .sharded_params import ShardedParameters
from .stage_policy import GradientPlacement, ParameterPlacement, StagePolicy


def install_module_hooks(model: nn.Module, parameters: ShardedParameters) -> list[Any]:
    """Gather before each module runs, free after; gather again when backward reaches its
    outputs. A forward of the whole model is one pass. Hooks hold the parameters weakly
    (the model must not keep a deleted engine alive)."""
    owner = weakref.ref(parameters)
    handles: list[Any] = []
    for module, units in parameters.plan.module_units:

        def before(module: nn.Module, args: Any, units: Sequence[int] = units) -> None:
            alive = owner()
            if alive is not None:
                alive.gatherer.enter(units)

        def after(module: nn.Module, args: Any, output: Any, units: Sequence[int] = units) -> None:
            alive = owner()
            if alive is not None:
                _after_module(alive, units, output)

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def root_before(module: nn.Module, args: Any) -> None:
        alive = owner()
        if alive is not None and alive.gatherer.phase is not Pass.BACKWARD:
            alive.gatherer.begin_pass(Pass.FORWARD)

    def root_after(module: nn.Module, args: Any, output: Any) -> None:
        alive = owner()
        if alive is not None and alive.gatherer.phase is not Pass.BACKWARD:
            alive.gatherer.end_pass()

    handles.append(model.register_forward_pre_hook(root_before, prepend=True))
    handles.append(model.register_forward_hook(root_after))
    return handles


def _after_module(parameters: ShardedParameters, units: Sequence[int], output: Any) -> None:
    """A module's forward ran: free its units (not during backward's recomputation, whose
    saved tensors backward is about to use), and arrange for them to be gathered again
    when backward reaches this module's outputs."""
    in_backward = parameters.gatherer.phase is Pass.BACKWARD
    parameters.gatherer.leave(units, free=not in_backward)
    if in_backward or not torch.is_grad_enabled():
        return
    owner = weakref.ref(parameters)

    def on_output_gradient(grad: torch.Tensor) -> None:
        alive = owner()
        if alive is None:
            return
        if alive.gatherer.phase is not Pass.BACKWARD:
            # Backward outside engine.backward: the module's parameters were freed after
            # forward and nothing gathers them, so autograd would fail on empty storage.
            raise RuntimeError(
                f"[rank {alive.comm.rank}] a backward pass outside engine.backward(loss) "
                "(loss.backward() or torch.autograd.grad) at stage 3: its parameters are "
                "partitioned and only engine.backward gathers them; call "
                "engine.backward(loss)"
            )
        alive.gatherer.fetch(units)

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(on_output_gradient)  # type: ignore[no-untyped-call]


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, list | tuple):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


POLICY = StagePolicy(
    name="stage 3",
    gradients=GradientPlacement.SHARDED,
    parameters=ParameterPlacement.SHARDED,
    shard_optimizer_states=True,
    module_hooks=install_module_hooks,
)
