"""``deepspeed.zero``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``.

Any other name of DeepSpeed's ``deepspeed.zero`` (TiledLinear, register_external_parameter,
MiCS_Init, ...) is refused by name.
"""

from ..param_status import ZeroParamStatus
from ..unsupported import refusing_module_getattr
from .gathered import GatheredParameters
from .init_context import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.zero",
    "provided: Init, GatheredParameters, ZeroParamStatus",
    "partitioning is the engine's; use zero_core.initialize's ZeroConfig for the rest",
)
