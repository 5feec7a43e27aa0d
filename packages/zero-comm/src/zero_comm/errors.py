"""Errors raised by zero_comm.

Every error raised from inside a collective carries the rank that raised it, as
``[rank R] <collective> ...``, so that the interleaved logs of N processes can be read.
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of the failures of a communicator (not of bad arguments)."""


class BackendUnavailableError(CommError):
    """The requested backend cannot run here (no CUDA for nccl, no mpi4py for mpi, ...)."""


class CollectiveMismatchError(CommError):
    """Ranks entered the same collective with different sizes, dtypes, ops or roots.

    Raised on every rank alike, so that none of them is left waiting in the next call.
    """


class CommTimeoutError(CommError):
    """A collective or the rendezvous did not complete within the communicator's timeout."""


class PeerFailureError(CommError):
    """A peer closed its connection in the middle of a collective: it most likely died."""


class LaunchEnvError(ValueError):
    """The launcher's environment variables are missing, malformed or contradict each other."""
