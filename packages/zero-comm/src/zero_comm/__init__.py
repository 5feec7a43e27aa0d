"""zero_comm: collectives over gloo, NCCL and MPI behind one interface.

    comm = zero_comm.init()                  # reads torchrun / mpirun / srun / zero-launch
    comm.all_reduce(grads)                   # in place, SUM
    comm.reduce_scatter(shard, flat_grads)   # flat_grads holds world_size chunks
    comm.all_gather(flat_params, shard)
    comm.stats["all_reduce"].volume_elements # ring-convention volume, exact

With ``deterministic=True`` every float reduction adds rank contributions in rank order, so
results are bit-identical on every backend and to the same sum done in one process.
"""

from .block_quantize import BlockQuantizer, Quantized
from .coalesced_gather import all_gather_coalesced
from .comm_options import CommOptions
from .communicator import Communicator
from .errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    LaunchEnvError,
    PeerFailureError,
)
from .handle import Handle
from .hierarchy import HybridGroups
from .launcher_env import LaunchEnv, detect_launch_env
from .quantized import (
    QuantizationFallbackWarning,
    QuantizedHandle,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from .reduce_op import ReduceOp
from .simulated import run_simulated
from .stats import CommStats, ring_volume
from .topology import Topology
from .world import detect_topology, init

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BlockQuantizer",
    "CollectiveMismatchError",
    "CommError",
    "CommOptions",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "Handle",
    "HybridGroups",
    "LaunchEnv",
    "LaunchEnvError",
    "PeerFailureError",
    "QuantizationFallbackWarning",
    "Quantized",
    "QuantizedHandle",
    "ReduceOp",
    "Topology",
    "__version__",
    "all_gather_coalesced",
    "detect_launch_env",
    "detect_topology",
    "init",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "ring_volume",
    "run_simulated",
]
