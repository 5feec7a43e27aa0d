"""zero_models: a GPT, tensor-parallel layers, data, and the zero-train command.

    from zero_models import GPT, GPTConfig, PRESETS
    with torch.device("meta"):
        model = GPT(PRESETS["gpt2"])                 # no parallel code in the model
    values = model.initial_values(seed=0)            # for zero_core.initialize(init_values=)

The default corpus (:func:`default_corpus_bytes`) is every machine's Python standard library.
Modules log under the logger ``zero_models`` (a ``NullHandler``: silent unless configured);
zero-train prints its own lines.
"""

import logging

from .corpus import default_corpus_bytes, stdlib_source_files
from .gpt import GPT, PRESETS, GPTConfig

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = ["GPT", "PRESETS", "GPTConfig", "__version__", "default_corpus_bytes",
           "stdlib_source_files"]  # fmt: skip
