"""TensorBoard event files of a zero-train run (``--tensorboard``, the ``tensorboard`` extra).

    train/loss, train/lr, train/tokens_per_s     one point per step, at metrics.jsonl's step
    train/grad_norm                               where known (clipping on, update applied)
    memory/rss_mib/rank0, memory/rss_mib/rank1 .. resident memory of each rank

The lead rank writes them from the same record as its line of ``OUT/metrics.jsonl``, so
the two hold the same values at the same steps. The folder (``--tensorboard DIR``, default
``OUT/tensorboard``) holds one run: a resumed run adds its own event file there, written
with ``purge_step`` at its first step, so TensorBoard drops what an earlier writer logged
at or after that step (the steps a cut-off run logged after its last checkpoint).

The writer is ``torch.utils.tensorboard.SummaryWriter``, which needs the tensorboard
package; :func:`tensorboard_available` is the check zero-train's options make before any
rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'zero-models[tensorboard]'"


def tensorboard_available() -> bool:
    """Whether torch's SummaryWriter can be imported (the tensorboard package is there,
    of a version torch accepts)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLog:
    """The lead rank's event writer in ``folder``; ``first_step``: the run's (or resumed
    segment's) first step, from which earlier events in the folder are dropped."""

    def __init__(self, folder: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=first_step)

    def write(self, record: dict[str, Any]) -> None:
        """The scalars of one metrics.jsonl step record, at its step."""
        step, add = int(record["step"]), self.writer.add_scalar
        add("train/loss", record["loss"], step)
        add("train/lr", record["lr"], step)
        add("train/tokens_per_s", record["tokens_per_s"], step)
        if record.get("grad_norm") is not None:
            add("train/grad_norm", record["grad_norm"], step)
        for rank, mib in enumerate(record["rss_mib"]):
            add(f"memory/rss_mib/rank{rank}", mib, step)

    def close(self) -> None:
        """Flush the pending events and close the file."""
        self.writer.close()
