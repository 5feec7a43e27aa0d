"""``zero_comm``'s public names load on first use (``__init__.py``): every exported name
resolves to the object its module defines, the names type checkers see are the ones that
load, and a wrong name is an AttributeError as on any module."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import zero_comm


def type_checking_imports() -> dict[str, str]:
    """Name -> module of the imports under ``if TYPE_CHECKING:`` in ``__init__.py``."""
    tree = ast.parse(Path(zero_comm.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {
        alias.name: str(statement.module)
        for statement in block.body
        if isinstance(statement, ast.ImportFrom)
        for alias in statement.names
    }


def test_every_exported_name_loads_from_its_module() -> None:
    names = set(zero_comm.__all__) - {"__version__"}
    assert names == set(zero_comm._HOMES), "__all__ and _HOMES name different things"
    assert type_checking_imports() == zero_comm._HOMES, (
        "the imports under TYPE_CHECKING (what mypy sees) differ from _HOMES (what loads)"
    )
    for name, home in zero_comm._HOMES.items():
        module = importlib.import_module(f"zero_comm.{home}")
        assert getattr(zero_comm, name) is getattr(module, name), name
    assert names <= set(dir(zero_comm))


def test_a_wrong_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Comunicator'"):
        _ = zero_comm.Comunicator  # type: ignore[attr-defined]
    assert not hasattr(zero_comm, "helper")


def test_names_load_in_a_fresh_process_by_every_import_form() -> None:
    probe = (
        "import sys, zero_comm\n"
        "assert 'torch' not in sys.modules\n"
        "from zero_comm import Communicator, init\n"
        "from zero_comm import *\n"
        "assert 'torch' in sys.modules and zero_comm.init is init\n"
        "print(len([n for n in zero_comm.__all__ if n in globals()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(zero_comm.__all__)
