"""Named ranges on a ``torch.profiler`` timeline, all under the prefix ``zero::``.

    with profiler_range("gather_unit"):          # zero::gather_unit
        ...
    with profiler_range(name, ".wait"):          # zero::all_gather.wait, for name "all_gather"
        ...

While a profiler records (``torch.profiler.profile``, ``torch.autograd.profiler.profile``)
each range is a ``torch.profiler.record_function`` and shows on the timeline of the thread
that ran it, beside torch's own operators. With no profiler running it is one shared
``nullcontext``: no ``record_function`` (about 5 us per range on a CPU even with nothing
recording) and no string built: about 0.3 us a range (a ``@ranged`` function the same
over a plain call; the communicator's waits test the flag themselves, 0.07 us), on a
2-core AMD EPYC VM where a stage-3 step of a small GPT in 4096-element buckets has ~200
ranges. Ranges on threads other than the profiler's own (the swap pipeline's I/O threads)
are recorded with ``experimental_config=torch._C._profiler._ExperimentalConfig(
profile_all_threads=True)``.

The names the ZeRO packages emit (docs/step-profile.md shows them on a timeline):

    zero::<collective>            a collective's launch (all_gather, reduce_scatter,
                                  all_reduce, all_to_all, broadcast, barrier, split,
                                  broadcast_object, all_gather_object); a synchronous
                                  one holds its wait too
    zero::<collective>.wait       waiting for it to complete (Handle.wait): blocked on
                                  the backend, then the local finish (the rank-ordered
                                  fold, AVG's division)
    zero::gather_unit             stage 3: launching the all-gathers of the units one
                                  demand or prefetch starts
    zero::gather_unit.wait        stage 3: waiting for one unit's, attaching its parameters
    zero::free_unit               stage 3: releasing a unit's gathered storage
    zero::optimizer_step          one optimizer.step() over a part of the master tiles
    zero::swap.read               reading one block of a swap file (an I/O thread, or
    zero::swap.write              the main one), writing one
    zero::swap.read.wait          the step or a gather waiting for swap reads, or the
    zero::swap.write.wait         pipeline for a buffer's writes to land
    zero::publish                 after the optimizer step: the parameters take the new
                                  values (stages 1-2: the all-gathers' last waits)
    zero::checkpoint.save         engine.save / engine.load, whole
    zero::checkpoint.load
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ParamSpec, TypeVar

from torch.autograd import profiler as _autograd_profiler
from torch.profiler import record_function

PREFIX = "zero::"

_P = ParamSpec("_P")
_R = TypeVar("_R")

# One context for every range while nothing records: entering it does nothing.
_NOTHING: AbstractContextManager[None] = nullcontext()


def profiling() -> bool:
    """Whether a torch profiler is recording now (torch sets the flag at its start)."""
    return bool(_autograd_profiler._is_profiler_enabled)


def profiler_range(name: str, suffix: str = "") -> AbstractContextManager[Any]:
    """``record_function("zero::" + name + suffix)`` while a profiler records, else a
    shared no-op context (the name is joined only when recorded)."""
    if _autograd_profiler._is_profiler_enabled:
        return record_function(PREFIX + name + suffix)
    return _NOTHING


def ranged(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` inside the range ``zero::<its name>`` while a profiler records; else
    called straight away (the hot path's wrapper: a flag test, no ``with``)."""
    name = PREFIX + function.__name__

    @functools.wraps(function)
    def in_range(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not _autograd_profiler._is_profiler_enabled:
            return function(*args, **kwargs)
        with record_function(name):
            return function(*args, **kwargs)

    return in_range
