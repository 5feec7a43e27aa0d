"""M_D for activation checkpoints: one pre-allocated contiguous buffer cut into slots.

Checkpoints live from a layer's forward to its backward, while short-lived activations are
allocated and freed around them; interleaving the two fragments memory (ZeRO-R, section
6.3). The arena allocates every checkpoint's storage at once, the first time a checkpoint
arrives, and hands out slots:

    buffer: [ slot 0 | slot 1 | ... | slot S-1 ]      S = slots, each slot_numel elements
             ^ layer 0's checkpoint, kept from its forward until its backward takes it back

A slot is free again when :meth:`give_back` is called (the checkpoint's backward gathered
it) or when the autograd graph holding it is dropped without a backward. A checkpoint
larger than a slot, or one arriving while every slot is taken (two forwards before one
backward), gets its own tensor instead: results stay right, and ``outside_arena``
counts how often that happened. When every slot is free and a larger checkpoint
arrives (a longer sequence), the arena is reallocated at the new size.
"""

from __future__ import annotations

import torch


class CheckpointArena:
    def __init__(self, slots: int, *, device: torch.device, pin_memory: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"an arena needs at least one slot, got slots={slots}")
        self.slots = slots
        self.device = device
        self.pin_memory = pin_memory
        self.buffer: torch.Tensor | None = None
        self.slot_numel = 0
        self._free: list[int] = []
        self.outside_arena = 0
        self.allocations = 0

    @property
    def bytes_reserved(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int | None]:
        """A 1-D tensor of ``numel`` elements and its slot (None: not in the arena)."""
        fits = self.buffer is not None and self.buffer.dtype == dtype and numel <= self.slot_numel
        if not fits and len(self._free) == (self.slots if self.buffer is not None else 0):
            self._allocate(numel, dtype)
            fits = True
        if not fits or not self._free:
            self.outside_arena += 1
            return torch.empty(
                numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory
            ), None
        assert self.buffer is not None
        slot = self._free.pop()
        start = slot * self.slot_numel
        return self.buffer[start : start + numel], slot

    def give_back(self, slot: int | None) -> None:
        if slot is not None and slot not in self._free:
            self._free.append(slot)

    def _allocate(self, numel: int, dtype: torch.dtype) -> None:
        self.buffer = None  # let the old one go before the new one is made
        self.buffer = torch.empty(
            self.slots * numel, dtype=dtype, device=self.device, pin_memory=self.pin_memory
        )
        self.slot_numel = numel
        self._free = list(range(self.slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.allocations += 1
