"""Where model states live (ZeRO-Offload / ZeRO-Infinity): the tiers, and the sub-groups
the master weights and optimizer states are cut into when they leave the device.

    tier     lives in                        the optimizer steps it
    DEVICE   the device (today's engine)     on the device, with the other device tiles
    HOST     host memory (pinned on a GPU)   on the host, with the other resident tiles
    DISK     swap files in offload_dir       on the host, one sub-group at a time, while
                                             the next is read and the last one written

On a CPU-only machine the host *is* the device: HOST then moves nothing, but runs the
same code (host tensors, gradient copies, the per-tile publish) as on a GPU.

Sub-groups (tiles). This rank's master of a group is its bucket slices, end to end. A
tier other than DEVICE cuts every bucket slice into tiles of at most
``offload_sub_group_numel`` elements; ``offload_fraction`` puts the last fraction of the
rank's elements (over all groups, in order) in the offload tier and leaves the rest on
the device, cutting one tile at the boundary:

    group 0 slices  | bucket 0 slice        | bucket 1 slice |
    tiles           | t0      | t1    | t2  | t3   | t4      |     (sub_group_numel cuts)
    fraction 0.4    | DEVICE            |   DISK           |     (cut at 60% of elements)

An elementwise optimizer gives the same bits whatever the tiling, so every tiling and
every tier equals the engine without offload, bit for bit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from enum import Enum

import torch

from ..group_layout import GroupLayout


class Tier(Enum):
    DEVICE = "none"
    HOST = "cpu"
    DISK = "disk"


@dataclass(frozen=True)
class TileSpec:
    """Elements [start, stop) of this rank's master of ``group`` (within bucket
    ``bucket``'s slice), and the tier they live in."""

    group: int
    bucket: int
    start: int
    stop: int
    tier: Tier

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def where(self) -> slice:
        return slice(self.start, self.stop)


def plan_tiles(
    layouts: list[GroupLayout], *, tier: Tier, sub_group_numel: int, fraction: float
) -> list[list[TileSpec]]:
    """Per group, the tiles of this rank's master; see the module docstring."""
    cuts: list[list[tuple[int, int, int]]] = []  # per group: (bucket, start, stop)
    for layout in layouts:
        cuts.append([])
        for k, bucket in enumerate(layout.buckets):
            start, end = bucket.local_offset, bucket.local_offset + bucket.slice_numel
            for a in range(start, end, sub_group_numel):
                cuts[-1].append((k, a, min(a + sub_group_numel, end)))
    total = sum(stop - start for group in cuts for _, start, stop in group)
    boundary = total - round(total * fraction)  # elements before it stay on the device
    plan: list[list[TileSpec]] = []
    seen = 0
    for g, group in enumerate(cuts):
        plan.append([])
        for k, start, stop in group:
            split = start + max(0, min(stop - start, boundary - seen))
            if split > start:
                plan[-1].append(TileSpec(g, k, start, split, Tier.DEVICE))
            if stop > split:
                plan[-1].append(TileSpec(g, k, split, stop, tier))
            seen += stop - start
    return plan


def host_device() -> torch.device:
    return torch.device("cpu")


_PIN_WARNED = False


def host_empty(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor of ``numel`` elements, pinned when ``pin`` and the device is a GPU
    (pinning falls back to pageable memory with one warning where it fails: a low
    memlock limit, a CPU-only torch)."""
    global _PIN_WARNED
    if pin and device.type == "cuda":
        try:
            return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)
        except RuntimeError as exc:
            if not _PIN_WARNED:
                _PIN_WARNED = True
                warnings.warn(
                    f"pinning host memory failed ({exc}); offloaded model states use pageable "
                    "memory (slower copies). Raise the memlock limit (ulimit -l) or set "
                    "offload_pin_memory=False to silence this",
                    stacklevel=2,
                )
    return torch.empty(numel, dtype=dtype, device="cpu")
