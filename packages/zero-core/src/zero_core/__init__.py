"""zero_core: ZeRO stages 0-3 written against zero_comm's Communicator.

    import zero_comm, zero_core
    comm = zero_comm.init(deterministic=True)
    engine = zero_core.initialize(model, torch.optim.AdamW(model.parameters()),
                                  zero_core.ZeroConfig(stage=2, param_dtype="bf16"), comm)
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()

With a deterministic communicator every stage's parameters equal stage 0's bit for bit.
"""

from .activation_checkpoint import ActivationCheckpointing
from .checkpoint import CheckpointError, DeterminismWarning
from .checkpoint_reader import complete_checkpoint
from .config import AVAILABLE_STAGES, ZeroConfig
from .deepspeed_config import DeepSpeedSetup, read_deepspeed
from .engine import Engine, ZeroEngine
from .initialize import initialize
from .memory import MemoryReport
from .memory_estimate import ModelStateBytes, model_state_bytes
from .memory_tracker import MemoryTracker
from .model_parallel import ModelParallel
from .safetensors_file import read_state_dict
from .sharded_state import ShardedState
from .swap_file import CorruptSwapError, SwapError, SwapSpaceError, check_offload_dir

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
    "ZeroConfig",
    "ZeroEngine",
    "__version__",
    "check_offload_dir",
    "complete_checkpoint",
    "initialize",
    "model_state_bytes",
    "read_deepspeed",
    "read_state_dict",
]
