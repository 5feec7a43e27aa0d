"""The rule of ``ZeroConfig.delayed_parameter_update``: which settings it needs and which
it cannot be combined with, and why (zero_core.delayed_update explains the mechanism)."""

from __future__ import annotations

from typing import Any


def delayed_update_error(config: Any) -> str:
    """Why ``config`` (a ZeroConfig, checking itself) cannot delay its parameter update by
    one step ("" if it can, or is not asked to): the one statement of the rule."""
    value = config.delayed_parameter_update
    if not isinstance(value, bool):
        return f"delayed_parameter_update={value!r} must be True or False"
    if not value:
        return ""
    if config.optimizer_in_backward:
        return (
            "delayed_parameter_update=True with optimizer_in_backward=True: the latter "
            "applies each bucket's update inside backward, so there is no step left to "
            "delay. Set one of them to False"
        )
    if config.offload_optimizer == "none":
        return (
            "delayed_parameter_update=True needs the optimizer offloaded: it runs step t's "
            "update on the host (master weights and optimizer states there) while the device "
            "runs step t+1, and with offload_optimizer='none' the update would write into the "
            "master weights the device computes with. Set offload_optimizer='cpu' (or 'disk', "
            "with offload_dir; stages 1-3), or delayed_parameter_update=False"
        )
    return ""
