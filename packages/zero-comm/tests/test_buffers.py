"""The pool of communication buffers (tier 1: pure, in one process).

A buffer is a 1-D view of a cached flat tensor ("its storage"). What the pool promises:
a buffer has the size and dtype asked for; buffers in flight never share memory; a
returned buffer is reused by a later ``take`` of the same dtype that fits in it, so a
steady loop allocates nothing; new storage holds the request's size class of elements
(at most 1/8 more, exactly the request for small multiples of a power of two).
"""

from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm.buffers import BufferPool, size_class

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8)
CPU = torch.device("cpu")


def storage_of(buffer: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage under ``buffer``."""
    storage = buffer.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def pool() -> BufferPool:
    return BufferPool(CPU)


# ------------------------------------------------------------------- one buffer


@given(numel=st.integers(0, 5000), dtype=st.sampled_from(DTYPES))
def test_take_gives_a_flat_buffer_of_the_size_and_dtype_asked(
    numel: int, dtype: torch.dtype
) -> None:
    buffers = pool()
    buffer = buffers.take(numel, dtype)
    assert buffer.shape == (numel,)
    assert buffer.dtype == dtype
    assert buffer.device == CPU
    assert buffer.is_contiguous()
    _, nbytes = storage_of(buffer)
    assert nbytes == size_class(numel) * buffer.element_size()
    assert buffers.bytes_held == nbytes
    buffer.fill_(1)  # writable, every element


def test_returned_buffer_is_reused() -> None:
    buffers = pool()
    first = buffers.take(100, torch.float32)
    address = first.data_ptr()
    buffers.give_back(first)
    second = buffers.take(100, torch.float32)
    assert second.data_ptr() == address
    assert buffers.bytes_held == size_class(100) * 4


@given(
    first=st.integers(1, 4096),
    second=st.integers(0, 4096),
    dtype=st.sampled_from(DTYPES),
)
def test_a_returned_buffer_serves_any_request_that_fits(
    first: int, second: int, dtype: torch.dtype
) -> None:
    """Storage of size_class(first) elements is reused for ``second`` exactly
    when ``second`` fits in it; otherwise the outgrown storage is dropped and new storage
    allocated."""
    buffers = pool()
    buffer = buffers.take(first, dtype)
    address, held = storage_of(buffer)
    buffers.give_back(buffer)
    again = buffers.take(second, dtype)
    assert again.shape == (second,)
    if second <= size_class(first):
        assert storage_of(again)[0] == address
        assert buffers.bytes_held == held
    else:
        assert storage_of(again)[0] != address
        assert buffers.bytes_held == size_class(second) * again.element_size()


def test_a_steady_loop_allocates_nothing_after_its_first_iteration() -> None:
    """What a training step does: the same few sizes taken and returned every step."""
    buffers = pool()
    sizes = [(1000, torch.float32), (250, torch.float32), (1000, torch.bfloat16), (7, torch.int64)]
    held_after_first = None
    for _ in range(5):
        taken = [buffers.take(n, d) for n, d in sizes]
        for buffer in reversed(taken):
            buffers.give_back(buffer)
        if held_after_first is None:
            held_after_first = buffers.bytes_held
        assert buffers.bytes_held == held_after_first
    itemsize = {d: torch.empty(0, dtype=d).element_size() for _, d in sizes}
    assert held_after_first == sum(size_class(n) * itemsize[d] for n, d in sizes)


def test_the_smallest_fitting_buffer_is_chosen() -> None:
    buffers = pool()
    big, small, middle = (buffers.take(n, torch.float32) for n in (1000, 10, 100))
    addresses = {n: storage_of(b)[0] for n, b in ((1000, big), (10, small), (100, middle))}
    for buffer in (big, small, middle):
        buffers.give_back(buffer)
    assert storage_of(buffers.take(50, torch.float32))[0] == addresses[100]
    assert storage_of(buffers.take(5, torch.float32))[0] == addresses[10]
    assert storage_of(buffers.take(5, torch.float32))[0] == addresses[1000]


def test_giving_back_a_slice_returns_its_whole_storage() -> None:
    """Callers may hand back a view of what they took; the whole storage comes back."""
    buffers = pool()
    buffer = buffers.take(64, torch.float32)
    address, _ = storage_of(buffer)
    buffers.give_back(buffer[10:20])
    assert storage_of(buffers.take(64, torch.float32))[0] == address


@pytest.mark.parametrize(
    ("given_back", "wanted"),
    [(torch.float32, torch.int32), (torch.float32, torch.bfloat16), (torch.int64, torch.float64)],
)
def test_dtypes_never_share_buffers(given_back: torch.dtype, wanted: torch.dtype) -> None:
    """A float32 buffer is not reused for int32 (same item size) or bfloat16 (fits twice)."""
    buffers = pool()
    buffer = buffers.take(64, given_back)
    address, held = storage_of(buffer)
    buffers.give_back(buffer)
    other = buffers.take(16, wanted)
    assert other.dtype == wanted
    assert storage_of(other)[0] != address
    assert buffers.bytes_held == held + 16 * other.element_size()


def test_clear_drops_the_free_buffers() -> None:
    buffers = pool()
    buffer = buffers.take(32, torch.float32)
    buffers.give_back(buffer)
    buffers.clear()
    assert buffers.bytes_held == 0
    buffers.take(32, torch.float32)
    assert buffers.bytes_held == 32 * 4, "after clear, a take allocates new storage"


# ------------------------------------------------------------- many in flight


class Take(NamedTuple):
    numel: int
    dtype: torch.dtype


class GiveBack(NamedTuple):
    position: int  # into the buffers in flight, modulo their number


operations = st.lists(
    st.one_of(
        st.builds(Take, st.integers(0, 300), st.sampled_from(DTYPES[:3])),
        st.builds(GiveBack, st.integers(0, 1000)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_any_sequence_keeps_buffers_in_flight_apart(ops: list[Take | GiveBack]) -> None:
    """A model of the pool: free storages per dtype. After every step,

    - a take reuses the smallest free storage of its dtype that fits, else drops the free
      storages of that dtype (all too small) and allocates the request's size class;
    - the storages of the buffers in flight are pairwise disjoint in memory;
    - ``bytes_held`` is the size of the storages in flight plus those free.
    """
    buffers = pool()
    in_flight: list[torch.Tensor] = []
    free: dict[torch.dtype, list[tuple[int, int]]] = {}  # (address, bytes) per dtype
    allocated: dict[int, int] = {}
    for op in ops:
        if isinstance(op, Take):
            buffer = buffers.take(op.numel, op.dtype)
            assert buffer.shape == (op.numel,)
            assert buffer.dtype == op.dtype
            address, nbytes = storage_of(buffer)
            itemsize = buffer.element_size()
            fitting = [s for s in free.get(op.dtype, []) if s[1] >= op.numel * itemsize]
            if fitting:
                best = min(fitting, key=lambda s: s[1])
                assert (address, nbytes) == best
                free[op.dtype].remove(best)
            else:
                for dropped, _ in free.pop(op.dtype, []):
                    del allocated[dropped]
                assert address not in allocated
                assert nbytes == size_class(op.numel) * itemsize
                allocated[address] = nbytes
            in_flight.append(buffer)
        elif in_flight:
            buffer = in_flight.pop(op.position % len(in_flight))
            free.setdefault(buffer.dtype, []).append(storage_of(buffer))
            buffers.give_back(buffer)
        spans = sorted(storage_of(b) for b in in_flight)
        for (a, a_bytes), (b, _) in itertools.pairwise(spans):
            assert a + a_bytes <= b, "two buffers in flight share memory"
        assert buffers.bytes_held == sum(allocated.values())


def test_buffers_in_flight_keep_their_contents() -> None:
    """Each buffer in flight is filled with its own index; none is overwritten by taking
    (and filling) the others, however the sizes and dtypes interleave."""
    buffers = pool()
    taken = [
        buffers.take(n, d)
        for n, d in [
            (5, torch.float32),
            (5, torch.float32),
            (3, torch.float32),
            (8, torch.int64),
            (1, torch.float32),
        ]
    ]
    for i, buffer in enumerate(taken):
        buffer.fill_(i)
    for i, buffer in enumerate(taken):
        assert torch.equal(buffer, torch.full_like(buffer, i))


def test_concurrent_takes_never_share_a_buffer() -> None:
    """8 threads each take, fill with their id, check, and give back, 200 times, with
    sizes that force reuse across threads. A buffer handed to two threads at once
    would show another thread's id."""
    buffers = pool()
    errors: list[str] = []
    start = threading.Barrier(8)

    def work(me: int) -> None:
        start.wait()
        for i in range(200):
            buffer = buffers.take(1 + (me * 7 + i) % 64, torch.int64)
            buffer.fill_(me)
            if not torch.equal(buffer, torch.full_like(buffer, me)):
                errors.append(f"thread {me} iteration {i} saw {buffer.tolist()}")
            buffers.give_back(buffer)

    threads = [threading.Thread(target=work, args=(me,)) for me in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    # A storage is allocated only when every one that fits is in flight (at most 7 others),
    # so each size class of 1, 2, ..., 64 holds at most 8 storages of int64.
    assert buffers.bytes_held <= 8 * sum({size_class(n) for n in range(1, 65)}) * 8


def test_pool_holds_no_more_than_the_peak_in_flight() -> None:
    """One buffer in flight at a time, growing: outgrown storage is not kept."""
    buffers = pool()
    peak = 0
    for numel in (3, 5, 9, 17):
        buffer = buffers.take(numel, torch.float32)
        peak = max(peak, size_class(numel) * 4)
        buffers.give_back(buffer)
    assert buffers.bytes_held <= peak


def test_giving_a_buffer_back_twice_cannot_make_two_takes_share_memory() -> None:
    buffers = pool()
    buffer = buffers.take(16, torch.float32)
    buffers.give_back(buffer)
    buffers.give_back(buffer)
    first, second = buffers.take(16, torch.float32), buffers.take(16, torch.float32)
    assert storage_of(first)[0] != storage_of(second)[0]
