"""tools/ as a package (tools/README.md): every tool imports as a module of it from the
repository root, none edits sys.path to find another, and each folder's README names each of
its files, so that a tool moved or added without its README line fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
FOLDERS = sorted(p for p in TOOLS.iterdir() if p.is_dir() and p.name != "__pycache__")
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in TOOLS.rglob("*.py")
    if p.name != "__init__.py"
)


def test_the_tools_are_found() -> None:
    assert "tools.peers.bench" in MODULES and "tools.common.provenance" in MODULES
    assert {f.name for f in FOLDERS} >= {"common", "peers", "cluster", "micro", "gpu"}


@pytest.mark.parametrize("module", MODULES)
def test_every_tool_imports_as_a_module_of_the_package(module: str) -> None:
    importlib.import_module(module)


def test_no_tool_edits_sys_path() -> None:
    edits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in TOOLS.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*=|sys\.path\s*\+=", line)
    ]
    assert not edits, f"import from the package tools instead: {edits}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_each_folders_readme_names_each_of_its_files(folder: Path) -> None:
    readme = (folder / "README.md").read_text()
    entries = [
        p.name + ("/" if p.is_dir() else "")
        for p in folder.iterdir()
        if p.name not in ("README.md", "__init__.py", "__pycache__")
    ]
    missing = [e for e in entries if f"`{e}`" not in readme]
    assert not missing, f"{folder.relative_to(ROOT)}/README.md does not name {missing}"


def test_the_top_readme_names_each_folder() -> None:
    readme = (TOOLS / "README.md").read_text()
    missing = [f.name for f in FOLDERS if f"[{f.name}/]({f.name}/README.md)" not in readme]
    assert not missing, f"tools/README.md does not name {missing}"
