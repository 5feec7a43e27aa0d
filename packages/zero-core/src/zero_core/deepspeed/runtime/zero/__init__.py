"""``deepspeed.runtime.zero``: ``partition_parameters`` and the names of ``deepspeed.zero``."""

from ...unsupported import refusing_module_getattr
from ...zero import GatheredParameters, Init, ZeroParamStatus
from . import partition_parameters

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters"]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.runtime.zero", "DeepSpeed's ZeRO internals", ""
)
