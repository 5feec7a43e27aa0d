"""One group's reduced gradient on this rank, held bucket slice by bucket slice, and only
while there is a gradient to hold.

    local shard of the group   | bucket 0 slice | bucket 1 slice | bucket 2 slice |
    pieces                       tensor 0         tensor 1         tensor 2
    between steps                (no storage)     (no storage)     (no storage)
    during backward              (no storage)     landed           landed          <- reduce-
    at step()                    landed           landed           landed             scatters
                                                                                       land last
                                                                                       bucket first

A piece gets its storage when its bucket's first reduced slice lands (``materialize``,
called by grad_reducer) and loses it when the step is done (``release``), as FSDP2 frees
gradients with ``zero_grad(set_to_none=True)``. So the forward pass holds no gradient
shard at all, and backward holds the shards of the buckets already reduced while the
activations of the layers not yet run are still alive: at stage 3 without activation
checkpointing the peak is max(12Ψ/N + activations, 16Ψ/N + one layer's working set)
instead of 16Ψ/N + activations (docs/stage3-memory.md).

Every bucket slice is one piece, so every view a consumer asks for (a master tile, a
parameter's local piece: both lie within one bucket slice) is a view of one tensor;
a range across two pieces is an error, not a silent copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


def materialize(tensor: torch.Tensor) -> None:
    """Give ``tensor`` storage if it has none (its contents are then undefined); a no-op
    for a tensor with storage. Views of a piece can only be made once it has storage."""
    storage = tensor.untyped_storage()
    needed = int(tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.nbytes() < needed:
        storage.resize_(needed)


def unallocated(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of ``numel`` elements with no storage yet (``materialize`` gives it some)."""
    # torch makes no tensor of a shape its storage cannot hold; allocate, then free (one
    # bucket slice at a time, at set-up)
    piece = torch.empty(numel, dtype=dtype, device=device)
    piece.untyped_storage().resize_(0)
    return piece


def has_storage(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0 or tensor.untyped_storage().nbytes() > 0


class ShardGradient:
    """A group's local gradient shard as one tensor per bucket slice (module docstring).

    Behaves like the flat shard for what step() does with it: ``g[a:b]`` (within one
    piece), ``g[a:b] = value``, ``div_``, ``mul_``, ``clone``, ``float``, ``numel``."""

    def __init__(self, pieces: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        """``pieces``: one tensor per bucket slice, in order; ``offsets``: where each
        starts in the local shard (contiguous: offsets[k + 1] = offsets[k] + numel)."""
        self.pieces = list(pieces)
        self.offsets = list(offsets)
        for k in range(1, len(self.pieces)):
            if self.offsets[k] != self.offsets[k - 1] + self.pieces[k - 1].numel():
                raise ValueError(f"piece {k} does not follow piece {k - 1}")

    @classmethod
    def unallocated(
        cls, numels: Sequence[int], offsets: Sequence[int], dtype: torch.dtype,
        device: torch.device | str,
    ) -> ShardGradient:  # fmt: skip
        """Pieces of ``numels`` elements with no storage yet."""
        return cls([unallocated(numel, dtype, device) for numel in numels], offsets)

    # ------------------------------------------------------------------ storage
    def release(self) -> None:
        """Free every piece's storage (views stay valid and get storage again by
        ``materialize``)."""
        for piece in self.pieces:
            piece.untyped_storage().resize_(0)

    def materialize_zeros(self) -> None:
        """Give storage (zeros) to the pieces that have none: a step after a backward in
        which some bucket never landed reads zeros there, as a flat shard would."""
        for piece in self.pieces:
            if not has_storage(piece):
                materialize(piece)
                piece.zero_()

    def nbytes(self) -> int:
        """Bytes of all pieces once they have storage: what the shard takes from backward to
        step."""
        return sum(p.numel() * p.element_size() for p in self.pieces)

    def held_bytes(self) -> int:
        """Bytes of the pieces that have storage now."""
        return sum(p.untyped_storage().nbytes() for p in self.pieces)

    # ------------------------------------------------------------- as a tensor
    def numel(self) -> int:
        return sum(p.numel() for p in self.pieces)

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype if self.pieces else torch.float32

    def _locate(self, where: slice) -> tuple[torch.Tensor, int, int]:
        start = 0 if where.start is None else where.start
        stop = self.numel() if where.stop is None else where.stop
        if where.step not in (None, 1) or start < 0 or stop < start:
            raise ValueError(f"ShardGradient takes a forward range, not {where}")
        k = max(0, bisect.bisect_right(self.offsets, start) - 1)
        if not self.pieces:
            raise IndexError("an empty ShardGradient has no elements")
        piece, offset = self.pieces[k], self.offsets[k]
        if stop > offset + piece.numel():
            raise ValueError(
                f"elements [{start}, {stop}) cross a bucket boundary of this gradient shard "
                f"(piece {k} ends at {offset + piece.numel()}); ask for one bucket's range"
            )
        return piece, start - offset, stop - offset

    def __getitem__(self, where: slice) -> torch.Tensor:
        piece, a, b = self._locate(where)
        return piece[a:b]

    def __setitem__(self, where: slice, value: torch.Tensor | float) -> None:
        piece, a, b = self._locate(where)
        piece[a:b] = value

    def div_(self, value: float) -> ShardGradient:
        for piece in self.pieces:
            piece.div_(value)
        return self

    def mul_(self, value: float) -> ShardGradient:
        for piece in self.pieces:
            piece.mul_(value)
        return self

    def clone(self) -> ShardGradient:
        return ShardGradient([p.clone() for p in self.pieces], self.offsets)

    def float(self) -> ShardGradient:
        """Itself when float32, else a float32 copy."""
        if self.dtype == torch.float32:
            return self
        return ShardGradient([p.float() for p in self.pieces], self.offsets)


GroupGradient = torch.Tensor | ShardGradient


def pieces_of(gradient: GroupGradient) -> list[torch.Tensor]:
    """The contiguous tensors a group's gradient is made of, in order."""
    return gradient.pieces if isinstance(gradient, ShardGradient) else [gradient]
