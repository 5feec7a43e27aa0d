"""Data sources, and the split of every global batch across data-parallel ranks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_models.data import BatchSampler, load_tokens
from zero_models.run_metrics import corpus_digest

TOKENS = torch.arange(1000) % 256


@given(st.sampled_from([1, 2, 3, 4, 6]), st.integers(1, 4), st.integers(0, 50), st.integers(0, 9))
def test_ranks_read_disjoint_rows_that_make_up_the_global_batch(
    dp: int, per_rank: int, step: int, seed: int
) -> None:
    """Concatenating the ranks' batches gives exactly the batch one rank would read alone,
    so the data a run sees does not depend on how many ranks share it."""
    batch = dp * per_rank
    alone = BatchSampler(TOKENS, context=8, global_batch=batch, dp_rank=0, dp_size=1, seed=seed)
    parts = [
        BatchSampler(TOKENS, context=8, global_batch=batch, dp_rank=r, dp_size=dp, seed=seed)
        for r in range(dp)
    ]
    whole = alone.batch(step)
    assert torch.equal(torch.cat([p.batch(step).inputs for p in parts]), whole.inputs)
    assert torch.equal(whole.targets[:, :-1], whole.inputs[:, 1:])


def test_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "2.txt").write_bytes(b"world")
    (folder / "1.txt").write_bytes(b"big ")
    (tmp_path / "t.u16").write_bytes(torch.tensor([1, 300, 65535], dtype=torch.int32)
                                     .to(torch.int16).numpy().tobytes())  # fmt: skip
    assert bytes(load_tokens(tmp_path / "a.txt").tolist()) == b"hello "
    assert bytes(load_tokens(folder).tolist()) == b"big world"
    assert load_tokens(tmp_path / "t.u16").tolist() == [1, 300, 65535]
    assert load_tokens(None, max_bytes=100).numel() == 100
    # Held narrow (the default corpus as int64 was 128 MiB on every rank).
    assert load_tokens(tmp_path / "a.txt").dtype == torch.uint8
    assert load_tokens(tmp_path / "t.u16").dtype == torch.int32
    assert load_tokens(None, max_bytes=100).dtype == torch.uint8


@given(
    st.lists(st.integers(0, 65535), min_size=20, max_size=300),
    st.integers(0, 30),
    st.integers(1, 4),
)
def test_narrow_tokens_give_the_batches_and_digest_of_int64_ones(
    values: list[int], step: int, batch: int
) -> None:
    """Batches are int64 whatever holds the stream, with the same values; the run record's
    corpus digest is the one of the int64 stream (chunked: cross a chunk's edge)."""
    wide = torch.tensor(values, dtype=torch.int64)
    narrow = wide.to(torch.int32 if max(values) > 255 else torch.uint8)
    samplers = [BatchSampler(t, context=8, global_batch=batch, dp_rank=0, dp_size=1, seed=step)
                for t in (wide, narrow)]  # fmt: skip
    expected, got = (s.batch(step) for s in samplers)
    assert got.inputs.dtype == got.targets.dtype == torch.int64
    assert torch.equal(got.inputs, expected.inputs) and torch.equal(got.targets, expected.targets)
    import zero_models.run_metrics as run_metrics

    chunk = run_metrics.DIGEST_CHUNK
    try:
        run_metrics.DIGEST_CHUNK = 7
        assert corpus_digest(narrow) == corpus_digest(wide)
    finally:
        run_metrics.DIGEST_CHUNK = chunk
    # The digest runs recorded before (one sha256 of the whole int64 stream): resumes match.
    assert corpus_digest(narrow) == "sha256:" + hashlib.sha256(wide.numpy().tobytes()).hexdigest()


def test_bad_data_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokens(tmp_path / "missing")
    (tmp_path / "odd.bin").write_bytes(b"123")
    with pytest.raises(ValueError, match="even size"):
        load_tokens(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match="does not split over 3"):
        BatchSampler(TOKENS, context=8, global_batch=4, dp_rank=0, dp_size=3)
