"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed-aware code imports
``ZeroParamStatus`` from (DeepSpeed-Chat's ZeRO-3 export, for one)."""

from ...param_status import ZeroParamStatus
from ...unsupported import refusing_module_getattr
from ...zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.runtime.zero.partition_parameters", "DeepSpeed's ZeRO internals", ""
)
