"""CopyStream: side-stream copies through a bounded staging ring (offload/copy_streams).

On CPU the copies run inline; the staging ring, the pieces and the event order are driven
here by a stand-in for the CUDA calls (RecordingStreams) that logs every call, runs the
side stream's copies when they are enqueued; its events complete when synchronized. The CUDA
tests run the real streams where a GPU exists and skip otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.offload.copy_streams import CopyStream, CopyTicket

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class LoggedEvent:
    """An event that completes only when the host synchronizes on it (the stand-in's
    side stream is never done by itself: a test sees every wait the code needs)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.completed = log, name, False

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")
        self.completed = True

    def query(self) -> bool:
        return self.completed


class RecordingStreams:
    """The Streams protocol on CPU: every call logged, side copies run at once."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events = 0
        self.kept: list[torch.Tensor] = []
        self.staged = 0
        self.pinned_storages: set[int] = set()
        self.held: list[torch.Tensor] = []

    def _event(self, where: str) -> LoggedEvent:
        self.events += 1
        name = f"{where}{self.events}"
        self.log.append(f"record {name}")
        return LoggedEvent(self.log, name)

    def record_current(self) -> LoggedEvent:
        return self._event("current")

    def record_side(self) -> LoggedEvent:
        return self._event("side")

    def side_waits(self, event: LoggedEvent) -> None:  # type: ignore[override]
        self.log.append(f"side waits {event.name}")

    def current_waits(self, event: LoggedEvent) -> None:  # type: ignore[override]
        self.log.append(f"current waits {event.name}")

    def on_side(self, copy: Callable[[], None]) -> None:
        self.log.append("copy")
        copy()

    def keep_alive(self, tensor: torch.Tensor) -> None:
        self.kept.append(tensor)

    def staging(self, nbytes: int) -> torch.Tensor:
        self.staged += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def pinned(self, tensor: torch.Tensor) -> bool:
        return any(tensor.untyped_storage().data_ptr() == p for p in self.pinned_storages)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Declare ``tensor`` pinned (CPU-only torch cannot pin); it is held, so its
        storage's address is not reused by another tensor meanwhile."""
        self.held.append(tensor)
        self.pinned_storages.add(tensor.untyped_storage().data_ptr())
        return tensor


def ring(slots: int = 2, slot_bytes: int = 64) -> tuple[CopyStream, RecordingStreams]:
    streams = RecordingStreams()
    return CopyStream(torch.device("cpu"), slots=slots, slot_bytes=slot_bytes, streams=streams), (
        streams
    )


def values(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).mul_(1000).to(dtype)


# ------------------------------------------------------------------- CPU path
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_cpu_copies_inline_with_the_bits_of_copy_(
    src_dtype: torch.dtype, dst_dtype: torch.dtype
) -> None:
    copies = CopyStream(torch.device("cpu"))
    src = values(1000, src_dtype)
    expected = torch.empty(1000, dtype=dst_dtype).copy_(src)
    for move in (copies.to_host, copies.to_device):
        dst = torch.zeros(1000, dtype=dst_dtype)
        ticket = move(src, dst)
        assert ticket.done  # inline: landed before the call returned
        assert torch.equal(dst, expected)
        ticket.wait_host()
        ticket.wait_stream()
    assert copies.inline and copies.staging_bytes == 0


def test_cpu_path_has_no_streams_and_no_staging() -> None:
    copies = CopyStream(torch.device("cpu"), slots=1, slot_bytes=16)
    src = values(10_000, torch.float32)
    dst = torch.empty(10_000)
    copies.to_host(src, dst)
    copies.drain()
    assert copies.streams is None and copies.staging_bytes == 0
    assert copies.bytes_to_host == 40_000


# ----------------------------------------------------- the staging ring on CPU
def test_a_copy_larger_than_a_slot_goes_in_pieces_and_lands_at_wait_host() -> None:
    copies, streams = ring(slots=2, slot_bytes=64)  # 16 float32 per slot
    src = values(40, torch.float32)
    dst = torch.zeros(40)
    ticket = copies.to_host(src, dst)
    assert len(ticket.pieces) == 3  # 16 + 16 + 8
    # Three pieces through two slots: the third reused slot 0, so the first piece was
    # waited for and copied out; the rest is still in the slots.
    assert torch.equal(dst[:16], src[:16]) and not dst[16:].any()
    assert not ticket.done
    ticket.wait_host()
    assert ticket.done and torch.equal(dst, src)
    assert copies.staging_bytes == 128 and streams.staged == 2
    assert streams.kept[0].data_ptr() == src.data_ptr()  # src marked for the side stream


def test_the_side_stream_waits_for_the_current_stream_before_copying() -> None:
    copies, streams = ring(slots=2, slot_bytes=64)
    ticket = copies.to_device(values(20, torch.float32), torch.zeros(20))
    assert streams.log == [
        "record current1",
        "side waits current1",
        "copy",
        "record side2",
        "copy",
        "record side3",
    ]
    ticket.wait_stream()
    assert streams.log[-1] == "current waits side3"  # the last piece covers the others
    assert not any(entry.startswith("sync") for entry in streams.log)  # no host wait


def test_a_full_ring_waits_for_its_oldest_copy_only() -> None:
    copies, streams = ring(slots=3, slot_bytes=64)
    tickets = [copies.to_host(values(16, torch.float32, i), torch.zeros(16)) for i in range(3)]
    assert not any(entry.startswith("sync") for entry in streams.log)
    copies.to_host(values(16, torch.float32, 3), torch.zeros(16))
    syncs = [entry for entry in streams.log if entry.startswith("sync")]
    assert syncs == ["sync side2"]  # the first copy's piece event, nothing else
    assert tickets[0].done and not tickets[1].done and not tickets[2].done
    assert copies.staging_bytes == 3 * 64


def test_to_device_stages_src_so_the_caller_may_change_it_at_once() -> None:
    copies, _ = ring(slots=2, slot_bytes=64)
    src = values(50, torch.float32)
    expected = src.to(torch.bfloat16)
    dst = torch.zeros(50, dtype=torch.bfloat16)
    ticket = copies.to_device(src, dst)
    src.zero_()
    ticket.wait_host()
    assert torch.equal(dst, expected)


def test_a_pinned_destination_of_the_same_dtype_is_written_directly() -> None:
    copies, streams = ring(slots=2, slot_bytes=64)
    src = values(100, torch.float32)
    dst = streams.pin(torch.zeros(100))
    ticket = copies.to_host(src, dst)
    assert streams.log == ["record current1", "side waits current1", "copy", "record side2"]
    assert len(ticket.pieces) == 1 and streams.staged == 0  # no staging, no host wait
    ticket.wait_host()
    assert streams.log[-1] == "sync side2" and torch.equal(dst, src)
    # another dtype needs the cast: through the ring
    half = streams.pin(torch.zeros(100, dtype=torch.float16))
    staged = copies.to_host(src, half)
    assert len(staged.pieces) == 7 and streams.staged == 2  # 16 float32 a slot, cast out
    copies.drain()
    assert torch.equal(half, src.half()) and staged.done


def test_drain_completes_in_call_order() -> None:
    copies, streams = ring(slots=4, slot_bytes=64)
    dsts = [torch.zeros(16) for _ in range(3)]
    for i, dst in enumerate(dsts):
        copies.to_host(values(16, torch.float32, i), dst)
    copies.drain()
    syncs = [entry for entry in streams.log if entry.startswith("sync")]
    assert syncs == ["sync side2", "sync side4", "sync side6"]
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, values(16, torch.float32, i))


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 4),
    slot_bytes=st.sampled_from([16, 24, 64, 100]),
    copies_made=st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 90),
            st.sampled_from(DTYPES),
            st.sampled_from(DTYPES),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_any_sequence_of_copies_equals_copy_and_stays_bounded(
    slots: int,
    slot_bytes: int,
    copies_made: list[tuple[bool, int, torch.dtype, torch.dtype, bool]],
) -> None:
    """Copies up and down, staged or (into pinned memory) direct, of any size and dtypes:
    after drain every destination equals ``copy_``, and staging never passed the ring."""
    copies, streams = ring(slots=slots, slot_bytes=slot_bytes)
    results: list[tuple[CopyTicket, torch.Tensor, torch.Tensor]] = []
    for i, (up, numel, src_dtype, dst_dtype, pinned) in enumerate(copies_made):
        src = values(numel, src_dtype, i)
        dst = torch.zeros(numel, dtype=dst_dtype)
        if pinned and numel:
            streams.pin(dst)
        ticket = copies.to_device(src, dst) if up else copies.to_host(src, dst)
        results.append((ticket, dst, torch.empty(numel, dtype=dst_dtype).copy_(src)))
        assert copies.staging_bytes <= slots * slot_bytes
    copies.drain()
    for ticket, dst, expected in results:
        assert ticket.done
        assert torch.equal(dst, expected)
    assert streams.staged <= slots


def test_misuse_is_named() -> None:
    copies = CopyStream(torch.device("cpu"))
    with pytest.raises(ValueError, match="same number"):
        copies.to_host(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        copies.to_host(torch.zeros(4, 4).t(), torch.zeros(16))
    with pytest.raises(ValueError, match="slots >= 1"):
        CopyStream(torch.device("cpu"), slots=0)


# ----------------------------------------------------------------- CUDA paths
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_to_host_is_ordered_after_the_work_that_made_src(pin: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    copies = CopyStream(device, slots=2, slot_bytes=1 << 16, pin=pin)
    base = torch.randn(1 << 20, device=device)
    src = base * 3  # queued on the current stream just before the copy
    dst = torch.empty(1 << 20, dtype=torch.float16)
    ticket = copies.to_host(src, dst)
    del src  # record_stream keeps its memory from being reused too early
    torch.randn(1 << 20, device=device)  # more work on the current stream
    ticket.wait_host()
    assert torch.equal(dst, (base * 3).half().cpu())
    assert all(b.is_pinned() == pin for b in copies._buffers)
    assert copies.staging_bytes <= 2 << 16


@cuda
def test_cuda_to_device_then_a_consumer_on_the_current_stream() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    copies = CopyStream(device, slots=3, slot_bytes=1 << 16)
    src = torch.randn(1 << 20)
    expected = src.to(torch.bfloat16)
    dst = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
    reader = dst.float().sum()  # queued before the copy: it must see the zeros
    ticket = copies.to_device(src, dst)
    src.zero_()  # staged: the caller may change src at once
    ticket.wait_stream()
    doubled = dst * 2  # the current stream reads dst after the copy, no host wait
    assert reader.item() == 0.0
    assert torch.equal(doubled.cpu(), expected * 2)
    assert torch.equal(dst.cpu(), expected)
    copies.drain()


@cuda
def test_cuda_to_host_into_pinned_memory_goes_straight_in_without_a_host_wait() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    copies = CopyStream(device, slots=1, slot_bytes=1 << 16)
    src = torch.randn(1 << 22, device=device)
    dst = torch.empty(1 << 22, pin_memory=True)
    ticket = copies.to_host(src, dst)
    assert len(ticket.pieces) == 1 and copies.staging_bytes == 0
    expected = src.cpu()
    ticket.wait_host()
    assert torch.equal(dst, expected)
    copies.drain()
