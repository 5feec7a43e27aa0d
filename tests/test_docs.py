"""The README and docs/ stand alone: every link and every path they name in backquotes is
a file of this repository (a README once sent users to ``../shared/DESIGN.md``, a folder
no clone has)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "packages").glob("*/README.md"),
     *(ROOT / "tools").rglob("README.md")]
)  # fmt: skip
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backquotes: starts at a top folder of the repository, or climbs out of one.
QUOTED_PATH = re.compile(r"`((?:\.\./|docs/|packages/|tools/|tests/|examples/)[\w./-]+)`")
# Folders a run creates (quoted as where results go), not files of the repository.
MADE_BY_RUNS = ("runs/", ".nox/", ".venv/")


def named_paths(doc: Path) -> list[str]:
    text = doc.read_text()
    links = [m for m in LINK.findall(text) if not re.match(r"[a-z]+:|#", m)]
    return [m.split("#")[0] for m in links] + QUOTED_PATH.findall(text)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_a_doc_names_is_in_the_repository(doc: Path) -> None:
    missing = []
    for name in named_paths(doc):
        if name.startswith(MADE_BY_RUNS) or not name:
            continue
        # Links are relative to the page; quoted paths to the page or to the root.
        bases = (doc.parent, ROOT)
        target = next((b / name for b in bases if (b / name).exists()), None)
        where = None if target is None else target.resolve()
        inside = where is not None and (where == ROOT or ROOT in where.parents)
        if not inside:
            missing.append(name)
    assert not missing, f"{doc.relative_to(ROOT)} names paths outside the repository: {missing}"


def test_the_check_sees_a_path_outside_the_repository(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("See `../shared/DESIGN.md` and [the design](../shared/DESIGN.md).\n")
    assert named_paths(page) == ["../shared/DESIGN.md", "../shared/DESIGN.md"]


def test_every_nox_session_is_listed_with_what_it_does() -> None:
    """The noxfile's header and the README's "Running things" name every session (the
    README also says how long each takes); a new session must be added to both."""
    noxfile = (ROOT / "noxfile.py").read_text()
    sessions = re.findall(r"@nox\.session[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", noxfile)
    assert {"lint", "tests", "train", "dev", "faults", "slow"} <= set(sessions), sessions
    header = noxfile.split('"""')[1]
    readme = (ROOT / "README.md").read_text()
    running = readme.split("## Running things")[1].split("\n## ")[0]
    for name in sessions:
        if name in ("lint", "tests"):  # ./nox itself, the README's second command
            continue
        assert f"nox -s {name} " in header, f"noxfile.py's docstring does not list {name}"
        assert re.search(rf"\./nox -s {name} .*#", running), f"README does not list {name}"
