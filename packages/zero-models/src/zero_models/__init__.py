"""zero_models: a GPT, tensor-parallel layers, data, and the zero-train command.

So far: the default corpus (:func:`default_corpus_bytes`), which every machine has.
"""

from .corpus import default_corpus_bytes, stdlib_source_files

__version__ = "0.1.0"

__all__ = ["__version__", "default_corpus_bytes", "stdlib_source_files"]
