"""The dataloader ``initialize(training_data=...)`` returns: the data set over the
data-parallel ranks, as DeepSpeed's ``DeepSpeedDataLoader`` gives it.

Each rank reads its own 1/N of the samples (``DistributedSampler``: shuffled with seed 0,
padded so every rank has as many, as DeepSpeed's), in micro-batches of
``train_micro_batch_size_per_gpu``, with the script's ``collate_fn``, and drops a last
short batch only with the config's ``dataloader_drop_last``. Data are read in this
process (no worker processes), so a run's batches do not depend on the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zero_comm import Communicator


def distributed_loader(
    data: Dataset[Any],
    comm: Communicator,
    micro_batch_size: int | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    drop_last: bool,
) -> DataLoader[Any]:
    """``data`` split over ``comm``'s ranks, in micro-batches (module doc)."""
    if micro_batch_size is None:
        raise ValueError(
            "initialize(training_data=...) needs a batch size: set "
            '"train_micro_batch_size_per_gpu" (or "train_batch_size") in the DeepSpeed config'
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=comm.world_size, rank=comm.rank
    )
    return DataLoader(
        data,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )
