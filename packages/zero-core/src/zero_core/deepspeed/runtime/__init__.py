"""``deepspeed.runtime``: only the path DeepSpeed-aware code imports ``ZeroParamStatus`` from
(``deepspeed.runtime.zero.partition_parameters``)."""

from ..unsupported import refusing_module_getattr
from . import zero

__all__ = ["zero"]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.runtime", "DeepSpeed's runtime internals", ""
)
