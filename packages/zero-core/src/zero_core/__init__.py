"""zero_core: ZeRO stages 0-3 written against zero_comm's Communicator.

    import zero_comm, zero_core
    comm = zero_comm.init(deterministic=True)
    engine = zero_core.initialize(model, torch.optim.AdamW(model.parameters()),
                                  zero_core.ZeroConfig(stage=2, param_dtype="bf16"), comm)
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()

With a deterministic communicator every stage's parameters equal stage 0's bit for bit.

Modules log to ``logging.getLogger(__name__)`` under the logger ``zero_core`` (a
``NullHandler`` here: silent unless the application configures logging); at DEBUG the
engine says what it built, e.g. each offload tier's swap folder, tiles and threads. Its
phases are named ranges on a ``torch.profiler`` trace (``zero::...``, see
zero_comm.profiler_ranges).
"""

import logging

from .checkpoint.format import CheckpointError
from .checkpoint.loader import DeterminismWarning
from .checkpoint.reader import complete_checkpoint
from .checkpoint.safetensors_file import read_state_dict
from .checkpoint.sharded_state import ShardedState
from .config.choices import AVAILABLE_STAGES
from .config.deepspeed_json import DeepSpeedSetup, read_deepspeed
from .config.zero_config import ZeroConfig
from .engine import Engine, ZeroEngine
from .estimate.model_states import ModelStateBytes, model_state_bytes
from .init_values import values_from_reset_parameters
from .initialize import initialize
from .memory.report import MemoryReport
from .memory.tracker import MemoryTracker
from .model_parallel import ModelParallel
from .offload.swap_file import CorruptSwapError, SwapError, SwapSpaceError, check_offload_dir
from .param_owner import is_partitioned
from .virtual_ranks import VirtualRanks
from .zero_r.activation_checkpoint import ActivationCheckpointing

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "AVAILABLE_STAGES",
    "ActivationCheckpointing",
    "CheckpointError",
    "CorruptSwapError",
    "DeepSpeedSetup",
    "DeterminismWarning",
    "Engine",
    "MemoryReport",
    "MemoryTracker",
    "ModelParallel",
    "ModelStateBytes",
    "ShardedState",
    "SwapError",
    "SwapSpaceError",
    "VirtualRanks",
    "ZeroConfig",
    "ZeroEngine",
    "__version__",
    "check_offload_dir",
    "complete_checkpoint",
    "initialize",
    "is_partitioned",
    "model_state_bytes",
    "read_deepspeed",
    "read_state_dict",
    "values_from_reset_parameters",
]
