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


def test_the_files_are_the_py_files_outside_site_packages_in_path_order(tmp_path: Path) -> None:
    """What the corpus is made of, on a tree with every case: site-packages (skipped, at
    any depth), a link to a folder (not followed), a link to a file (read), a broken link,
    a folder named like a source, and names that sort differently as strings than as
    paths ("a-b" < "a/" as strings, "a" < "a-b" as paths)."""
    for name in ["a/x.py", "a-b/y.py", "a/site-packages/no.py", "site-packages/no.py",
                 "b/c/d.py", "b/c/notes.txt", "top.py", "real/inner.py"]:  # fmt: skip
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")
    (tmp_path / "folder.py").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "b/link.py").symlink_to(tmp_path / "top.py")
    (tmp_path / "b/broken.py").symlink_to(tmp_path / "nowhere.py")
    names = [p.relative_to(tmp_path).as_posix() for p in stdlib_source_files(tmp_path)]
    assert names == ["a/x.py", "a-b/y.py", "b/c/d.py", "b/link.py", "real/inner.py", "top.py"]


def test_a_folder_without_sources_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        default_corpus_bytes(10, root=tmp_path)
    inside = tmp_path / "site-packages"
    (inside / "pkg").mkdir(parents=True)
    (inside / "pkg" / "m.py").write_text("x = 1\n")
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        stdlib_source_files(inside)


def test_the_package_stands_on_zero_core() -> None:
    assert zero_core.__version__
