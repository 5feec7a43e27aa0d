"""``deepspeed.pipe`` (PipelineModule, LayerSpec, the pipeline engine): refused by name.

from zero_core.deepspeed.pipe import PipelineModule    # UnsupportedFeatureError
"""

from ..unsupported import refusing_module_getattr

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed.pipe",
    "pipeline parallelism",
    "zero_core has no pipeline engine; train the whole model with ZeRO (stage 3 partitions "
    "its parameters) or tensor parallelism (zero_core.ModelParallel)",
)
