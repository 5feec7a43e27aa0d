"""``zero_core.deepspeed``: DeepSpeed's API over zero_core's engine.

A script written for DeepSpeed runs after changing its imports and its launcher:

    import zero_core.deepspeed as deepspeed                       # was: import deepspeed
    from zero_core.deepspeed.accelerator import get_accelerator   # was: deepspeed.accelerator

    zero-launch -n 2 python train.py --deepspeed_config ds.json   # or torchrun; was: deepspeed

Provided: ``initialize`` (-> engine, optimizer, dataloader, lr_scheduler),
``init_distributed``, ``add_config_arguments``, ``DeepSpeedEngine``; ``zero`` (``Init``,
``GatheredParameters``, ``ZeroParamStatus``) and ``runtime.zero.partition_parameters``;
``utils`` (``safe_get_full_*``, ``zero_to_fp32``); ``accelerator.get_accelerator``;
``ops.adam`` (FusedAdam and DeepSpeedCPUAdam as torch's AdamW). What the engine cannot
honour is refused by name (:class:`UnsupportedFeatureError`): ``moe``, ``pipe``, the rest
of ``ops``, any other attribute of this package, options of the functions above that
would change what the engine does, and feature sections of the config.

At stage 3 the parameters carry DeepSpeed's ``ds_id``/``ds_status``/``ds_numel``/
``ds_shape`` markers under this facade only (param_status.py says why). The
communicator is deterministic: every stage gives the same result as stage 0.
docs/coming-from-deepspeed.md walks through a ported script.
"""

from . import accelerator, moe, ops, pipe, runtime, utils, zero
from .distributed import add_config_arguments, init_distributed
from .engine import DeepSpeedEngine
from .initialize import Initialized, initialize
from .unsupported import UnsupportedFeatureError, refusing_module_getattr

__all__ = [
    "DeepSpeedEngine",
    "Initialized",
    "UnsupportedFeatureError",
    "accelerator",
    "add_config_arguments",
    "init_distributed",
    "initialize",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "utils",
    "zero",
]

__getattr__ = refusing_module_getattr(
    "zero_core.deepspeed",
    "not part of the DeepSpeed facade",
    "it provides " + ", ".join(__all__),
)
