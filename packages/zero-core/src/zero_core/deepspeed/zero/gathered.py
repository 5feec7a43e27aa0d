"""``GatheredParameters``: DeepSpeed's context manager over the core engine's
``gathered_parameters``.

    with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()       # kept, and seen by every rank after

DeepSpeed's takes parameters alone; the engine that owns them is found in the record
zero_core.param_owner, filled by ``initialize``. Parameters of several engines are gathered
engine by engine; parameters no facade engine owns are left as they are, as DeepSpeed
leaves parameters that are not ZeRO-3's (a model not yet passed to ``initialize``: with
zero.Init here it is whole anyway). Unlike DeepSpeed at stages 0-2, where the block does
nothing, an engine's parameters go through its ``gathered_parameters`` at every stage, so
a ``modifier_rank`` edit reaches every rank and the master weights at every stage.

Inside the block the stage-3 parameters' ``ds_status`` is AVAILABLE (param_status.py).
Tensors kept from the block (``v.data.cpu()``) stay valid after it (the core engine's
contract).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from types import TracebackType

import torch
from torch import nn

from ...param_owner import by_owner
from ..param_status import ZeroParamStatus, set_status
from ..unsupported import unsupported


class GatheredParameters:
    """Collective: ``params`` (one parameter or an iterable) whole inside the block;
    with ``modifier_rank``, that rank's changes are kept and broadcast (module doc).
    ``enabled=False`` makes it do nothing, as DeepSpeed's."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise unsupported(
                "GatheredParameters(fwd_module=...) (registering external parameters)",
                "gather and use the parameters inside the block instead",
            )
        if isinstance(params, torch.Tensor):
            params = [params]  # type: ignore[list-item]
        self.params: list[nn.Parameter] = list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stack = ExitStack()

    def __enter__(self) -> None:
        if not self.enabled:
            return
        with ExitStack() as stack:
            for engine, mine in by_owner(self.params):
                stack.enter_context(
                    engine.gathered_parameters(mine, modifier_rank=self.modifier_rank)
                )
            self._stack = stack.pop_all()
        set_status(self.params, ZeroParamStatus.AVAILABLE)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        if not self.enabled:
            return None
        set_status(self.params, ZeroParamStatus.NOT_AVAILABLE)
        return self._stack.__exit__(kind, error, traceback)
