"""The repository's tools: benchmarks, the emulated cluster, GPU checks and diagnostics, one
folder per family (tools/README.md lists them).

No distribution ships them and no package imports them. Every tool is a module run from the
repository root, ``python -m tools.peers.bench --help``, and tools share code by importing it
from this package (``from tools.common.provenance import git_head``), so none edits sys.path.
A tool that starts another (one process per rank, a child) starts it as ``python -m tools...``
too: the child inherits the working folder, or the PYTHONPATH, through which its parent found
this package.
"""
