"""Copies between the device and host memory on a side stream, ordered by events, through
a bounded ring of pinned staging buffers (ZeRO-Offload's overlapped transfers).

    current stream   | backward b0 | backward b1 | backward b2 | ...
                           ^ event e0    ^ event e1
    side stream            | wait e0, D2H b0 -> slot 0 | wait e1, D2H b1 -> slot 1 |
    host                                         slot 0 -> dst (at wait_host / reuse)

``to_host(src, dst)`` copies a device tensor into a host tensor: an event recorded on the
current stream orders the copy after the work queued there so far (the work that
produced ``src``); the side stream waits on it. A ``dst`` in pinned memory of ``src``'s
dtype is written directly (no staging, and the host never waits at the call: what a
gradient going down during backward needs); any other ``dst`` gets ``src`` piece by piece
through the pinned staging slots, an event per piece. Either way ``dst`` holds the values
once the ticket's ``wait_host()`` returned (or ``drain()``): that is when the slots are
copied out (with a cast where the dtypes differ), and the caller must not read or write
``dst`` before.

``to_device(src, dst)`` copies a host tensor into a device tensor: each piece of ``src`` is
copied (and cast to ``dst``'s dtype) into a staging slot on the host, so ``src`` may be
changed or freed as soon as ``to_device`` returns; the side stream waits for the current
stream's work so far (which may still read ``dst``), then copies the slot up. A device
consumer calls ``ticket.wait_stream()``: the current stream waits on the copy's event,
the host does not.

Memory: ``slots`` x ``slot_bytes`` of pinned host memory, allocated on first use, per
CopyStream. A staged copy larger than a slot goes in pieces of one slot each; when the
next slot is still in use, the oldest copy in it is waited for (an event synchronize on
that piece, never a device-wide synchronize), so a copy of any size needs no more
staging. Direct copies (into pinned memory) use none.

Lifetime of device tensors: each device tensor a copy reads or writes on the side stream
is marked with ``Tensor.record_stream(side)``, so the caching allocator does not hand its
memory to another tensor before the side stream's work queued at its free has run. The
caller may drop its reference as soon as the call returned. Host tensors: a ticket holds
``dst`` of ``to_host`` until the ticket is done (its values land there at completion).

On a device that is not CUDA (device.type == "cpu"), every copy runs inline with
``Tensor.copy_`` when called, no staging, streams, events or threads exist, and every
ticket is done: the values and the bits are those of a plain ``dst.copy_(src)``.

Order: copies run on one side stream in call order; tickets complete in that order.
Threads: a CopyStream is used by one thread at a time; "the current stream" is the
calling thread's (torch keeps one per thread).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .tiers import host_empty

DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 4 << 20


class Event(Protocol):
    """What a copy waits on: torch.cuda.Event's two calls used here."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Streams(Protocol):
    """The stream and event calls a CopyStream makes (CUDA, or a stand-in in tests)."""

    def record_current(self) -> Event:
        """An event recorded on the current stream now."""
        ...

    def record_side(self) -> Event:
        """An event recorded on the side stream now."""
        ...

    def side_waits(self, event: Event) -> None:
        """The side stream waits (on the device) for ``event``."""
        ...

    def current_waits(self, event: Event) -> None:
        """The current stream waits (on the device) for ``event``."""
        ...

    def on_side(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` (which enqueues device work) with the side stream current."""
        ...

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Mark ``tensor`` (device) as used by the side stream (record_stream)."""
        ...

    def staging(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of ``nbytes`` bytes (uint8)."""
        ...

    def pinned(self, tensor: torch.Tensor) -> bool:
        """Whether the host ``tensor`` is in pinned memory (a copy may go straight in)."""
        ...


class CudaStreams:
    """Streams on one CUDA device: a side stream of its own, events from torch.cuda."""

    def __init__(self, device: torch.device, pin: bool = True) -> None:
        self.device = device
        self.pin = pin
        self.side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def _current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record_current(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._current())
        return event

    def record_side(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.side)
        return event

    def side_waits(self, event: Event) -> None:
        assert isinstance(event, torch.cuda.Event)
        self.side.wait_event(event)

    def current_waits(self, event: Event) -> None:
        assert isinstance(event, torch.cuda.Event)
        self._current().wait_event(event)

    def on_side(self, copy: Callable[[], None]) -> None:
        with torch.cuda.stream(self.side):
            copy()

    def keep_alive(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.side)

    def pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def staging(self, nbytes: int) -> torch.Tensor:
        # Pageable staging (pin=False) is what offload_pin_memory=False asks for: the
        # copies still run on the side stream, but the driver stages them itself. Pinning
        # that fails (a low memlock limit) falls back to pageable, with one warning.
        return host_empty(nbytes, torch.uint8, self.device, self.pin)


@dataclass(eq=False)
class _Piece:
    """One slot's worth of a copy: done when ``event`` has completed and ``finish`` (the
    host copy out of the slot, for a D2H piece) has run."""

    slot: int
    event: Event
    finish: Callable[[], None] | None
    done: bool = False

    def complete(self) -> None:
        if self.done:
            return
        self.event.synchronize()
        if self.finish is not None:
            self.finish()
        self.done = True


@dataclass(eq=False)
class CopyTicket:
    """A copy in flight: ``wait_host()`` for a host consumer, ``wait_stream()`` for a
    device consumer. A ticket of the CPU path is done when made."""

    pieces: list[_Piece] = field(default_factory=list)
    streams: Streams | None = None
    hold: Any = None  # the host tensor the copy lands in, until done

    @property
    def done(self) -> bool:
        return all(piece.done for piece in self.pieces)

    def wait_host(self) -> None:
        """Block the host until the copy landed (event synchronize on its pieces, then
        the slots' values copied out into a host destination)."""
        for piece in self.pieces:
            piece.complete()
        self.hold = None

    def wait_stream(self) -> None:
        """Make the current stream wait for the copy (no host wait): for a consumer on
        the device of a to_device copy. A no-op on the CPU path."""
        if self.streams is not None and self.pieces:
            self.streams.current_waits(self.pieces[-1].event)


def _flat(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"copy_streams: {what} must be contiguous (got strides {tensor.stride()} for "
            f"shape {tuple(tensor.shape)}); pass tensor.contiguous() or a flat buffer"
        )
    return tensor.view(-1)


class CopyStream:
    """Side-stream copies between ``device`` and host memory; see the module docstring.

    ``slots`` x ``slot_bytes`` bound the pinned staging memory; ``pin=False`` stages in
    pageable memory (offload_pin_memory=False). ``streams`` replaces the CUDA calls (tests
    drive the staging ring on CPU with a stand-in); by default a CUDA device gets
    CudaStreams and any other device copies inline.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        pin: bool = True,
        streams: Streams | None = None,
    ) -> None:
        if slots < 1 or slot_bytes < 16:
            raise ValueError(
                f"CopyStream needs slots >= 1 and slot_bytes >= 16; got slots={slots}, "
                f"slot_bytes={slot_bytes}"
            )
        if device.type == "cuda" and device.index is None and streams is None:
            device = torch.device("cuda", torch.cuda.current_device())  # as tensors name it
        self.device = device
        self.pin = pin
        self.slots = slots
        self.slot_bytes = slot_bytes
        if streams is None and device.type == "cuda":
            streams = CudaStreams(device, pin)
        self.streams = streams
        self._buffers: list[torch.Tensor] = []
        self._occupant: list[_Piece | None] = [None] * slots
        self._direct: deque[_Piece] = deque()  # to_host copies into pinned memory
        self._next = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @property
    def inline(self) -> bool:
        """True where copies run inline (no streams: the CPU path)."""
        return self.streams is None

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers allocated so far (at most slots x slot_bytes)."""
        return sum(b.numel() for b in self._buffers)

    # ------------------------------------------------------------------ ring
    def _take_slot(self) -> tuple[int, torch.Tensor]:
        """The next slot of the ring, its previous piece completed first (bounded)."""
        assert self.streams is not None
        slot = self._next
        self._next = (slot + 1) % self.slots
        previous = self._occupant[slot]
        if previous is not None:
            previous.complete()
            self._occupant[slot] = None
        if slot == len(self._buffers):
            self._buffers.append(self.streams.staging(self.slot_bytes))
        return slot, self._buffers[slot]

    def _piece_numel(self, dtype: torch.dtype) -> int:
        return max(1, self.slot_bytes // dtype.itemsize)

    # ----------------------------------------------------------------- copies
    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        """Copy ``src`` (device) into ``dst`` (host, same numel; cast to its dtype) after
        the current stream's work so far; ``dst`` holds the values after
        ``wait_host()`` (or ``drain()``)."""
        flat_src, flat_dst = _flat(src, "src"), _flat(dst, "dst")
        self._check(flat_src, flat_dst)
        self.bytes_to_host += flat_src.numel() * flat_src.element_size()
        if self.streams is None:
            flat_dst.copy_(flat_src)
            return CopyTicket()
        streams = self.streams
        ticket = CopyTicket(streams=streams, hold=dst)
        streams.side_waits(streams.record_current())  # after the work that made src
        streams.keep_alive(flat_src)
        if flat_dst.dtype == flat_src.dtype and streams.pinned(flat_dst):
            # Straight into the caller's pinned memory: no staging, no host wait.
            def direct() -> None:
                flat_dst.copy_(flat_src, non_blocking=True)

            streams.on_side(direct)
            piece = _Piece(-1, streams.record_side(), None)
            self._direct.append(piece)
            ticket.pieces.append(piece)
            self._prune_direct()
            return ticket
        step = self._piece_numel(flat_src.dtype)
        for a in range(0, flat_src.numel(), step):
            b = min(a + step, flat_src.numel())
            slot, buffer = self._take_slot()
            staged = _typed(buffer, flat_src.dtype, b - a)
            part = flat_src[a:b]

            def launch(staged: torch.Tensor = staged, part: torch.Tensor = part) -> None:
                staged.copy_(part, non_blocking=True)

            streams.on_side(launch)
            out = flat_dst[a:b]

            def finish(out: torch.Tensor = out, staged: torch.Tensor = staged) -> None:
                out.copy_(staged)

            piece = _Piece(slot, streams.record_side(), finish)
            self._occupant[slot] = piece
            ticket.pieces.append(piece)
        return ticket

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        """Copy ``src`` (host, same numel) into ``dst`` (device; cast to its dtype on the
        host, into the staging slot) after the current stream's work so far; ``src`` may
        change once this returns. A device consumer calls ``wait_stream()``."""
        flat_src, flat_dst = _flat(src, "src"), _flat(dst, "dst")
        self._check(flat_dst, flat_src)
        self.bytes_to_device += flat_dst.numel() * flat_dst.element_size()
        if self.streams is None:
            flat_dst.copy_(flat_src)
            return CopyTicket()
        streams = self.streams
        ticket = CopyTicket(streams=streams)
        streams.side_waits(streams.record_current())  # after the work still reading dst
        streams.keep_alive(flat_dst)
        step = self._piece_numel(flat_dst.dtype)
        for a in range(0, flat_dst.numel(), step):
            b = min(a + step, flat_dst.numel())
            slot, buffer = self._take_slot()
            staged = _typed(buffer, flat_dst.dtype, b - a)
            staged.copy_(flat_src[a:b])  # on the host: the slot's piece, cast
            part = flat_dst[a:b]

            def launch(staged: torch.Tensor = staged, part: torch.Tensor = part) -> None:
                part.copy_(staged, non_blocking=True)

            streams.on_side(launch)
            piece = _Piece(slot, streams.record_side(), None)
            self._occupant[slot] = piece
            ticket.pieces.append(piece)
        return ticket

    def _prune_direct(self) -> None:
        """Forget the direct copies that have landed (an event query, no wait)."""
        while self._direct and (self._direct[0].done or self._direct[0].event.query()):
            self._direct.popleft().done = True

    def drain(self) -> None:
        """Complete every copy in flight (event synchronize on each piece, in order)."""
        while self._direct:
            self._direct.popleft().complete()
        for offset in range(self.slots):
            slot = (self._next + offset) % self.slots
            piece = self._occupant[slot]
            if piece is not None:
                piece.complete()
                self._occupant[slot] = None

    def _check(self, device_side: torch.Tensor, host_side: torch.Tensor) -> None:
        if device_side.numel() != host_side.numel():
            raise ValueError(
                f"copy_streams: src has {device_side.numel()} elements and dst "
                f"{host_side.numel()}; a copy needs the same number on both sides"
            )
        if host_side.device.type != "cpu":
            raise ValueError(
                f"copy_streams: the host side of a copy must be in host memory, got "
                f"{host_side.device}; to_host(device, host), to_device(host, device)"
            )
        if device_side.device != self.device and not (
            self.streams is None and device_side.device.type == "cpu"
        ):
            raise ValueError(
                f"copy_streams: this CopyStream serves {self.device}, the device side is on "
                f"{device_side.device}; make one CopyStream per device"
            )


def _typed(buffer: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of a uint8 staging slot, viewed as ``dtype``."""
    return buffer[: numel * dtype.itemsize].view(dtype)
