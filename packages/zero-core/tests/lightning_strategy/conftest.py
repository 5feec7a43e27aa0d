"""Lightning's one-process tests may leave torch.distributed initialised in the pytest
process (a Trainer's strategy sets it up); later tests of the same process (zero_comm's
refusals without a group, say) must find it as they would alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
