"""zero_comm: collectives over gloo, NCCL and MPI behind one interface.

    comm = zero_comm.init()                  # reads torchrun / mpirun / srun / zero-launch
    comm = zero_comm.from_process_group()    # or adopts a torch.distributed group made already
    comm.all_reduce(grads)                   # in place, SUM
    comm.reduce_scatter(shard, flat_grads)   # flat_grads holds world_size chunks
    comm.all_gather(flat_params, shard)
    comm.stats["all_reduce"].volume_elements # ring-convention volume, exact

With ``deterministic=True`` every float reduction adds rank contributions in rank order, so
results are bit-identical on every backend and to the same sum done in one process.

The names below load on first use (PEP 562), so a process that only launches ranks
(``zero-launch``, ``python -m zero_comm.launch``) never imports torch: it starts the ranks
about two seconds sooner and holds no copy of torch beside them.

Modules log to ``logging.getLogger(__name__)`` under the logger ``zero_comm``, which has a
``NullHandler``: nothing shows unless the application configures logging (e.g.
``logging.basicConfig()`` and ``logging.getLogger("zero_comm").setLevel(logging.DEBUG)``
to see each communicator as it is created).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adopt import from_mpi_comm, from_process_group
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
    from .node_detection import detect_topology
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
    from .world import init

# A library adds no handler of its own but this one, so that an application that has not
# configured logging does not get Python's "last resort" output of our warnings.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# Each public name and the module that defines it.
_HOMES = {
    "BlockQuantizer": "block_quantize",
    "Quantized": "block_quantize",
    "all_gather_coalesced": "coalesced_gather",
    "CommOptions": "comm_options",
    "Communicator": "communicator",
    "BackendUnavailableError": "errors",
    "CollectiveMismatchError": "errors",
    "CommError": "errors",
    "CommTimeoutError": "errors",
    "LaunchEnvError": "errors",
    "PeerFailureError": "errors",
    "Handle": "handle",
    "HybridGroups": "hierarchy",
    "LaunchEnv": "launcher_env",
    "detect_launch_env": "launcher_env",
    "QuantizationFallbackWarning": "quantized",
    "QuantizedHandle": "quantized",
    "quantized_all_gather": "quantized",
    "quantized_reduce_scatter": "quantized",
    "ReduceOp": "reduce_op",
    "run_simulated": "simulated",
    "CommStats": "stats",
    "ring_volume": "stats",
    "Topology": "topology",
    "detect_topology": "node_detection",
    "init": "world",
    "from_process_group": "adopt",
    "from_mpi_comm": "adopt",
}


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use and keep the name here."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


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
    "from_mpi_comm",
    "from_process_group",
    "init",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "ring_volume",
    "run_simulated",
]
