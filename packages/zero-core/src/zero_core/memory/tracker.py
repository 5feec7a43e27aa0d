"""Peak memory of each phase of a training step, measured on this rank.

    tracker = MemoryTracker(device)
    with tracker.phase("forward"):  loss = loss_fn(engine(batch))
    with tracker.phase("backward"): engine.backward(loss)
    with tracker.phase("step"):     engine.step()
    tracker.peaks["backward"].peak_bytes

What "memory" is depends on the device:

- CUDA: bytes allocated by PyTorch's caching allocator (``max_memory_allocated``, reset at
  each phase start); ``reserved_bytes`` adds what the allocator holds but has not handed
  out, whose excess over allocated bytes is fragmentation.
- CPU: the process's resident set. Its high-water mark (VmHWM) is reset at each phase
  start by writing 5 to /proc/self/clear_refs (Linux). Before that, glibc's malloc_trim
  returns the pages of freed heap blocks to the system, so memory freed in an earlier
  phase is not counted as in use by this one. Resident bytes include what is not
  tensors (the interpreter, libraries, the communicator's connections): compare peaks with
  the resident bytes at the start of the step (``PhasePeak.start_bytes``), not with zero.

Where the high-water mark cannot be reset (not Linux), ``exact`` is False and the peak
is the larger of the resident bytes at the phase's start and end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from .host_heap import release_free_heap
from .proc_status import process_status_kib


class PhasePeak(NamedTuple):
    """Bytes in use on this rank at a phase's start and at its highest point; with the
    categories (``categories()`` of the tracker, e.g. model states) read at its end."""

    phase: str
    start_bytes: int
    peak_bytes: int
    reserved_bytes: int
    categories: dict[str, int]

    @property
    def above_start(self) -> int:
        return self.peak_bytes - self.start_bytes


class MemoryTracker:
    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        categories: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.categories = categories
        self.peaks: dict[str, PhasePeak] = {}
        self.history: list[PhasePeak] = []
        self.exact = self.device.type == "cuda" or _can_reset_high_water_mark()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak of the enclosed code; stored under ``peaks[name]``."""
        start = self._reset()
        yield
        peak = max(self._peak(), start)
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else peak
        categories = self.categories() if self.categories is not None else {}
        record = PhasePeak(name, start, peak, reserved, categories)
        self.peaks[name] = record
        self.history.append(record)

    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _status_kib("VmRSS") * 1024

    def step_peak(self, phases: tuple[str, ...] = ("forward", "backward", "step")) -> int:
        """The highest peak among ``phases`` of the last step."""
        return max(self.peaks[p].peak_bytes for p in phases if p in self.peaks)

    def _reset(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self.current_bytes()
        release_free_heap()
        if self.exact:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current resident set
        return self.current_bytes()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.exact:
            return _status_kib("VmHWM") * 1024
        return self.current_bytes()


def _status_kib(field: str) -> int:
    found = process_status_kib(field)
    if found is not None:
        return found
    import resource  # not Linux: the lifetime peak is all there is

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _can_reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False
