"""What a rank holds, by category, counted from the tensors themselves."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch


class MemoryReport(NamedTuple):
    """Bytes one rank holds. ``gradients`` are what the gradients take from backward to
    the step (sharded gradients are freed between steps); ``comm_buffers`` are the
    communicator's pooled staging buffers, bounded by ``bucket_numel`` and
    ``max_buckets_in_flight``."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    buffers: int
    comm_buffers: int
    host: int = 0  # offloaded model states and their staging buffers in host memory
    disk: int = 0  # offloaded model states in swap files
    # Offloaded gradients (ZeroConfig.offload_gradients): the most device bytes they take
    # on their way to host or disk, (max_buckets_in_flight + 1) x the largest reduction's
    # slice in the gradient dtype: the reductions in flight (their outputs are pooled, in
    # comm_buffers) and the landed slices awaiting their copy (in gradients). 0 when the
    # gradients stay on the device.
    gradients_in_flight: int = 0
    # Several micro-batch slots per rank (ZeroConfig.micro_batches_per_rank): the most
    # bytes of gradient copies held for the slots before the last (zero_core.slot_rows),
    # on the device in the gradient dtype; 0 with one slot per rank.
    slot_copies: int = 0

    @property
    def model_states(self) -> int:
        """The paper's model states: parameters, gradients, master weights, optimizer states."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states

    @property
    def total(self) -> int:
        """Bytes on the device (host and disk tiers apart)."""
        return self.model_states + self.buffers + self.comm_buffers + self.slot_copies


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
