"""``zero.Init``: DeepSpeed's partition-at-construction context, as build whole, shard at
``initialize``.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()                  # built whole on this rank, in its own dtype
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)  # sharded here

DeepSpeed partitions each module's parameters as its constructor returns, so no rank ever
holds the whole model. Here the block does nothing: the model is built whole, and stage 3
shards it at ``initialize``, which then frees what this rank does not keep. The training
is the same; the memory is not: between construction and ``initialize`` every rank holds
the whole model in its construction dtype (4 bytes per parameter in float32, where
DeepSpeed holds 2/N in 16 bits). For a model that does not fit whole, build it on the
meta device and give its values to ``zero_core.initialize(..., init_values=...)``, which
shards them as they arrive.

DeepSpeed's arguments are honoured or refused: those that change nothing here
(``module``, ``config_dict_or_path``, ``enabled``, ``mem_efficient_linear``, ``dtype=None``
or float32) are accepted; the others (a 16-bit ``dtype``: the parameters are not converted
at construction, set "bf16"/"fp16" in the config; ``remote_device``, ``pin_memory``,
process groups, ``mpu``, quantized weights, ``param_swapper``, ``tensor_overrides``)
raise naming themselves and what to do instead. One consequence of building in float32:
the master weights start from the float32 initial values, where DeepSpeed's start from
values already rounded to 16 bits.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..unsupported import refuse_unless_default, unsupported

OFFLOAD_ADVICE = (
    "where the shards live is the config's zero_optimization.offload_param.device, applied "
    "at initialize"
)


class Init:
    """A context in which models are built (module doc: built whole, sharded at initialize)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        if remote_device not in (None, "none"):
            raise unsupported(f"zero.Init(remote_device={remote_device!r})", OFFLOAD_ADVICE)
        if dtype not in (None, torch.float32):
            raise unsupported(
                f"zero.Init(dtype={dtype})",
                "models are built in their own dtype and the engine makes 16-bit compute "
                'copies at initialize: set "bf16" or "fp16" in the config',
            )
        refuse_unless_default(
            "zero.Init",
            {
                "pin_memory": (pin_memory, False, OFFLOAD_ADVICE),
                "data_parallel_group": (
                    data_parallel_group,
                    None,
                    "stage 3 shards over the data-parallel communicator of initialize",
                ),
                "mpu": (mpu, None, "pass a zero_core.ModelParallel to zero_core.initialize"),
                "zero_param_parallel_group": (
                    zero_param_parallel_group,
                    None,
                    'set zero_optimization "zero_hpz_partition_size" in the config',
                ),
                "zero_quantized_weights": (
                    zero_quantized_weights,
                    False,
                    'set zero_optimization "zero_quantized_weights" in the config',
                ),
                "zero_quantized_nontrainable_weights": (
                    zero_quantized_nontrainable_weights,
                    False,
                    "frozen parameters are kept whole",
                ),
                "sequence_data_parallel_group": (sequence_data_parallel_group, None, ""),
                "param_swapper": (param_swapper, None, OFFLOAD_ADVICE),
                "tensor_overrides": (
                    tensor_overrides,
                    None,
                    "tensors are built in their own dtype and device",
                ),
            },
        )
        self.enabled = enabled
        self.module = module  # already built: sharded at initialize like the others

    def __enter__(self) -> Init:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None
