"""``deepspeed.moe`` (mixture of experts): refused by name; zero_core has no expert parallelism.

from zero_core.deepspeed.moe.layer import MoE    # UnsupportedFeatureError
"""

from ..unsupported import refusing_module_getattr

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.moe",
    "mixture of experts, expert parallelism",
    "zero_core partitions dense models only; build the experts as ordinary modules",
)
