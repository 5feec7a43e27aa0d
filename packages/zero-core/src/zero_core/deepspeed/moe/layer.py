"""``deepspeed.moe.layer`` (``MoE``): importing it raises, naming the missing feature."""

from ..unsupported import unsupported

raise unsupported(
    "zero_core.deepspeed.moe.layer (mixture of experts, expert parallelism)",
    "zero_core partitions dense models only; build the experts as ordinary modules",
)
