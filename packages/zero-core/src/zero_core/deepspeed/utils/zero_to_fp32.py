"""DeepSpeed's ``zero_to_fp32``: a checkpoint folder's whole float32 model, in one process.

    state = get_fp32_state_dict_from_zero_checkpoint("checkpoints")        # follows latest
    convert_zero_checkpoint_to_fp32_state_dict("checkpoints", "model.bin")  # torch.save

Reads what ``save_checkpoint`` wrote, for any world size and stage, through
zero_core.checkpoint.consolidate (``zero-consolidate`` writes the same as safetensors).
Keys are the model's own (no ``module.`` prefix), as DeepSpeed's; buffers and frozen
parameters are included.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ...checkpoint.consolidate import SavedModel, consolidate
from ..unsupported import refuse_unless_default


def _folder(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    return Path(checkpoint_dir) if tag is None else Path(checkpoint_dir) / str(tag)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The float32 state dict of ``checkpoint_dir/latest`` (or ``checkpoint_dir/<tag>``);
    CheckpointError naming the file when there is none or it is damaged."""
    refuse_unless_default(
        "get_fp32_state_dict_from_zero_checkpoint",
        {
            "exclude_frozen_parameters": (
                exclude_frozen_parameters,
                False,
                "drop the frozen names from the returned dict",
            ),
            "lazy_mode": (lazy_mode, False, "zero-consolidate streams one tensor at a time"),
        },
    )
    return dict(SavedModel(_folder(checkpoint_dir, tag)).state_dict(torch.float32))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    tag: str | None = None,
    safe_serialization: bool = False,
) -> None:
    """Write the float32 state dict to ``output_file``: ``torch.save`` (load it with
    ``torch.load``), or safetensors with ``safe_serialization``."""
    folder = _folder(checkpoint_dir, tag)
    if safe_serialization:
        consolidate(folder, Path(output_file), torch.float32)
        return
    torch.save(get_fp32_state_dict_from_zero_checkpoint(folder), output_file)


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Load the checkpoint's float32 weights into ``model`` (strictly) and return it."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model
