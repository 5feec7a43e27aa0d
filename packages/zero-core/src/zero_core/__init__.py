"""zero_core: ZeRO partitioning and stages, written against zero_comm.

So far: the paper's model-state memory formulas (:func:`model_state_bytes`, and the
``zero-estimate`` command). The engine (stages 0-3) builds on zero_comm's Communicator.
"""

from .memory_estimate import ModelStateBytes, model_state_bytes

__version__ = "0.1.0"

__all__ = ["ModelStateBytes", "__version__", "model_state_bytes"]
