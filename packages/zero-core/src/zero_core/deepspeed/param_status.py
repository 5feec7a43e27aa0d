"""``ZeroParamStatus`` and the ``ds_*`` markers a stage-3 parameter carries under the facade.

DeepSpeed-aware code (DeepSpeed-Chat, many training scripts) detects a partitioned
parameter with ``hasattr(p, "ds_id")`` and ``p.ds_status == ZeroParamStatus.NOT_AVAILABLE``,
then gathers it with ``deepspeed.zero.GatheredParameters``. Without the markers it takes
its "not partitioned" path and reads stage 3's placeholders (NaN). So under
``zero_core.deepspeed.initialize`` at stage 3 every trainable parameter carries:

    ds_id      its index among the engine's trainable parameters
    ds_status  NOT_AVAILABLE, or AVAILABLE inside a ``zero.GatheredParameters`` block
    ds_numel   the whole parameter's element count
    ds_shape   the whole parameter's shape (torch.Size)

Only the facade adds them (this module is its only writer): ``zero_core.initialize``
leaves parameters bare, because libraries that import the real ``deepspeed`` (PEFT,
transformers) test ``hasattr(p, "ds_numel")`` and then call real DeepSpeed's functions on
the parameter, which would fail or do the wrong thing on ours. A script that uses the
facade is one that imports no real DeepSpeed. Stages 0-2 add nothing, as DeepSpeed does
(their parameters are whole). The status follows the facade's GatheredParameters only:
inside ``engine.gathered_parameters`` of the core engine it stays NOT_AVAILABLE.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from torch import nn

from ..engine import Engine


class ZeroParamStatus(Enum):
    """DeepSpeed's partitioned-parameter states (the same names and values)."""

    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # partitioned: this rank holds its shard only
    INFLIGHT = 3  # being gathered (never seen outside the engine here)


MARKERS = ("ds_id", "ds_status", "ds_numel", "ds_shape")


def mark_partitioned(engine: Engine) -> None:
    """Give every trainable parameter of a stage-3 ``engine`` the ``ds_*`` markers."""
    for slot in engine.slots:
        p = slot.param
        p.ds_id = slot.index  # type: ignore[attr-defined]
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
        p.ds_numel = slot.numel  # type: ignore[attr-defined]
        p.ds_shape = p.shape  # type: ignore[attr-defined]


def set_status(params: Iterable[nn.Parameter], status: ZeroParamStatus) -> None:
    """Set ``ds_status`` of the marked parameters among ``params``."""
    for p in params:
        if hasattr(p, "ds_id"):
            p.ds_status = status  # type: ignore[attr-defined]
