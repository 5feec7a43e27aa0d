"""The default corpus is deterministic, byte-exact and needs no download."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_core
from zero_models import default_corpus_bytes, stdlib_source_files


def test_default_corpus_is_the_stdlib_source_in_sorted_order() -> None:
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    tokens = default_corpus_bytes(100_000)
    assert tokens.dtype == torch.uint8 and tokens.numel() == 100_000
    expected = b"".join(p.read_bytes() for p in files)[:100_000]
    assert bytes(tokens.tolist()) == expected


def test_a_folder_without_sources_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        default_corpus_bytes(10, root=tmp_path)


def test_the_package_stands_on_zero_core() -> None:
    assert zero_core.__version__
