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

Offloaded slices (``offload_gradients``, offload.gradient_tier). A bucket slice whose
gradient lives in host memory or in swap files is *away*: its piece here is the device
landing tensor (no storage between landings) and ``away[k]`` reads the accumulated values
back. The scaling the step applies to the whole gradient (``div_`` by N x steps x loss
scale, ``mul_`` by the clipping coefficient) is applied to the resident pieces at once
and recorded for the away ones, which get it, in the same order and with the same
arithmetic as the device would use (``scale_like_device``), each time they are read:

    resident piece    g.float() -> div_(d) -> mul_(c)                   (once, in place)
    away slice        read() -> float32 copy -> div_(d) -> mul_(c)      (on every read)

so an away slice reads back with the bits the device path gives its piece.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple, Protocol

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


class AwaySlice(Protocol):
    """A bucket slice of the gradient kept off the device (offload.gradient_tier)."""

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of this step's accumulated slice, in the gradient dtype,
        on the host (a view for host memory: do not change it; a copy for disk)."""
        ...

    @property
    def landed(self) -> bool:
        """Whether this step's gradient has landed (a slice not landed is never read)."""
        ...


class Scale(NamedTuple):
    """One scaling of the whole gradient, replayed on every read of an away slice."""

    op: str  # "div" or "mul"
    value: float
    device_type: str  # the device whose arithmetic it reproduces


def scale_like_device(values: torch.Tensor, scale: Scale) -> None:
    """Scale ``values`` (float32, host) in place with the bits ``div_``/``mul_`` by the
    same Python float give on ``scale.device_type``.

    CUDA divides by a scalar as a multiplication by its float32 reciprocal (PyTorch's
    div_true_kernel_cuda: "a * reciprocal(b)", one bit from the division at most), so
    a slice scaled on the host for a CUDA run does the same; the CPU divides."""
    if scale.op == "mul":
        values.mul_(scale.value)
    elif scale.device_type == "cuda":
        one = torch.ones((), dtype=torch.float32)
        values.mul_(float(one / torch.tensor(scale.value, dtype=torch.float32)))
    else:
        values.div_(scale.value)


class ShardGradient:
    """A group's local gradient shard as one tensor per bucket slice (module docstring).

    Behaves like the flat shard for what step() does with it: ``g[a:b]`` (within one
    piece), ``g[a:b] = value``, ``div_``, ``mul_``, ``clone``, ``float``, ``numel``.
    ``away``: bucket slices (by piece index) whose values live off the device; reading
    ``g[a:b]`` there gives a float32 host copy with the recorded scaling applied."""

    def __init__(
        self,
        pieces: Sequence[torch.Tensor],
        offsets: Sequence[int],
        away: dict[int, AwaySlice] | None = None,
        device_type: str = "cpu",
    ) -> None:
        """``pieces``: one tensor per bucket slice, in order; ``offsets``: where each
        starts in the local shard (contiguous: offsets[k + 1] = offsets[k] + numel);
        ``device_type``: the compute device's, whose arithmetic the away slices'
        scaling reproduces."""
        self.pieces = list(pieces)
        self.offsets = list(offsets)
        self.away: dict[int, AwaySlice] = dict(away or {})
        self.device_type = device_type
        self.scales: list[Scale] = []  # applied to the away slices on every read
        for k in range(1, len(self.pieces)):
            if self.offsets[k] != self.offsets[k - 1] + self.pieces[k - 1].numel():
                raise ValueError(f"piece {k} does not follow piece {k - 1}")

    def resident(self) -> list[torch.Tensor]:
        """The pieces that are not away, in order."""
        return [p for k, p in enumerate(self.pieces) if k not in self.away]

    def away_values(self, k: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of away slice ``k``: a float32 host copy, scaled as the
        resident pieces were (module docstring)."""
        stop = self.pieces[k].numel() if stop is None else stop
        values = self.finished(self.away[k].read(start, stop))
        return values

    def finished(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` (an away slice's accumulated values, gradient dtype, host) as the step
        applies them: a float32 copy with every recorded scaling replayed."""
        values = raw.to(torch.float32, copy=True)
        for scale in self.scales:
            scale_like_device(values, scale)
        return values

    def scale_away(self, op: str, value: float) -> None:
        """Record a scaling for the away slices (the resident ones are scaled by the
        caller)."""
        if self.away:
            self.scales.append(Scale(op, value, self.device_type))

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
        self.scales.clear()

    def materialize_zeros(self) -> None:
        """Give storage (zeros) to the resident pieces that have none: a step after a
        backward in which some bucket never landed reads zeros there, as a flat shard
        would."""
        for piece in self.resident():
            if not has_storage(piece):
                materialize(piece)
                piece.zero_()

    def nbytes(self) -> int:
        """Bytes of the resident pieces once they have storage: what the shard takes on
        the device from backward to step (away slices are the gradient tier's)."""
        return sum(p.numel() * p.element_size() for p in self.resident())

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
        k, a, b = self._locate_index(where)
        return self.pieces[k], a, b

    def _locate_index(self, where: slice) -> tuple[int, int, int]:
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
        return k, start - offset, stop - offset

    def __getitem__(self, where: slice) -> torch.Tensor:
        """A view of a resident piece; a float32 host copy of an away slice."""
        k, a, b = self._locate_index(where)
        if k in self.away:
            return self.away_values(k, a, b)
        return self.pieces[k][a:b]

    def away_at(self, where: slice) -> int | None:
        """The index of the away slice ``where`` lies in, or None if it is resident."""
        k, _, _ = self._locate_index(where)
        return k if k in self.away else None

    def __setitem__(self, where: slice, value: torch.Tensor | float) -> None:
        k, a, b = self._locate_index(where)
        piece = self.pieces[k]
        if k in self.away:
            raise RuntimeError(
                "a slice of this gradient lives in host memory or on disk "
                "(offload_gradients) and is read-only here; clone() the gradient first"
            )
        piece[a:b] = value

    def div_(self, value: float) -> ShardGradient:
        for piece in self.resident():
            piece.div_(value)
        self.scale_away("div", value)
        return self

    def mul_(self, value: float) -> ShardGradient:
        for piece in self.resident():
            piece.mul_(value)
        self.scale_away("mul", value)
        return self

    def clone(self) -> ShardGradient:
        """A copy whose pieces are all resident: away slices come back as float32 host
        copies, scaled (so a clone of a float32 gradient is float32 throughout)."""
        return ShardGradient(
            [
                self.away_values(k) if k in self.away else p.clone()
                for k, p in enumerate(self.pieces)
            ],
            self.offsets,
            device_type=self.device_type,
        )

    def float(self) -> ShardGradient:
        """Itself when float32, else a float32 copy (away slices stay away: they are
        read in float32)."""
        if self.dtype == torch.float32:
            return self
        copy = ShardGradient(
            [p if k in self.away else p.float() for k, p in enumerate(self.pieces)],
            self.offsets,
            self.away,
            self.device_type,
        )
        copy.scales = list(self.scales)
        return copy


GroupGradient = torch.Tensor | ShardGradient


def pieces_of(gradient: GroupGradient) -> list[torch.Tensor]:
    """The contiguous device tensors a group's gradient is made of, in order (not its
    away slices: ``divide_away`` scales and checks those)."""
    return gradient.resident() if isinstance(gradient, ShardGradient) else [gradient]


def divide_away(gradients: Sequence[GroupGradient], denominator: float) -> bool:
    """Record the division by ``denominator`` for every away slice (the resident pieces
    were divided by the caller) and return whether every away value is finite after it.
    Reads each away slice once (host memory, or the swap files one slice at a time)."""
    finite = True
    for gradient in gradients:
        if not isinstance(gradient, ShardGradient) or not gradient.away:
            continue
        gradient.scale_away("div", denominator)
        for k in gradient.away:
            if not bool(torch.isfinite(gradient.away_values(k)).all()):
                finite = False
    return finite
