"""The pool's size classes and its release (issue 17): a staging buffer is at most 1/8
larger than asked for (a power of two was up to 2x), a training step's usual sizes fit
their class exactly, and ``release_free`` hands idle buffers back without touching those
in flight."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_comm.buffers import BufferPool, size_class

CPU = torch.device("cpu")


@given(numel=st.integers(0, 1 << 40))
def test_a_size_class_holds_the_request_with_at_most_an_eighth_more(numel: int) -> None:
    capacity = size_class(numel)
    assert capacity >= max(numel, 1)
    assert 8 * capacity <= 9 * numel or capacity - numel <= 1


@given(multiple=st.integers(1, 16), shift=st.integers(0, 30))
def test_small_multiples_of_a_power_of_two_fit_exactly(multiple: int, shift: int) -> None:
    """Bucket sizes, padded buckets and a rank's slice of them (3 * 2^20, 2^22, 786432)."""
    assert size_class(multiple << shift) == multiple << shift


def test_a_gpt_bucket_is_not_rounded_to_the_next_power_of_two() -> None:
    """A 1024-wide GPT's qkv bucket (3 * 2^20 elements) took 2^22 (4 MiB more) before."""
    pool = BufferPool(CPU)
    pool.take(3 * 2**20, torch.float32)
    assert pool.bytes_held == 3 * 2**20 * 4


def test_release_free_drops_idle_buffers_and_keeps_those_in_flight() -> None:
    pool = BufferPool(CPU)
    idle, busy = pool.take(1000, torch.float32), pool.take(500, torch.float32)
    busy.fill_(7)
    pool.give_back(idle)
    pool.release_free()
    assert pool.bytes_held == size_class(500) * 4, "only the buffer in flight is held"
    assert torch.equal(busy, torch.full_like(busy, 7))
    pool.give_back(busy)  # still the pool's: reused by the next take that fits
    again = pool.take(500, torch.float32)
    assert again.data_ptr() == busy.data_ptr()
    assert pool.bytes_held == size_class(500) * 4
