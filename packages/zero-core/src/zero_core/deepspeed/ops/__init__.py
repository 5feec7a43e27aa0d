"""``deepspeed.ops``: DeepSpeed's compiled kernels.

Only the Adam optimizers are provided (``ops.adam``: FusedAdam and DeepSpeedCPUAdam are
torch's Adam/AdamW, see there). Every other kernel (transformer, sparse attention, LAMB,
quantizer, ...) is refused by name.
"""

from ..unsupported import refusing_module_getattr
from . import adam

__all__ = ["adam"]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.ops",
    "DeepSpeed's compiled kernels",
    "only ops.adam (FusedAdam, DeepSpeedCPUAdam as torch's AdamW) is provided; use the torch "
    "module or optimizer the kernel replaces",
)
