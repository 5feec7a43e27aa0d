"""The dependency direction zero_models -> zero_core -> zero_comm, checked two ways.

Statically: no module of a package imports a package above it, and only zero_comm imports
torch.distributed or mpi4py. Dynamically: importing a package loads none above it.
(`nox -s lint` checks the same with import-linter.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["zero_comm", "zero_core", "zero_models"]  # bottom to top
NETWORK = ("torch.distributed", "mpi4py")


def imported_modules(package: str) -> dict[str, set[str]]:
    src = ROOT / "packages" / package.replace("_", "-") / "src" / package
    found: dict[str, set[str]] = {}
    for path in src.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("index", range(len(LAYERS)))
def test_no_import_points_up_the_layers(index: int) -> None:
    package, above = LAYERS[index], LAYERS[index + 1 :]
    for path, names in imported_modules(package).items():
        upward = {n for n in names if n.split(".")[0] in above}
        assert not upward, f"{path} imports {upward}, above {package} in the layers"
        if package != "zero_comm":
            network = {n for n in names if n.startswith(NETWORK)}
            assert not network, f"{path} reaches the network without zero_comm: {network}"


@pytest.mark.parametrize("index", range(len(LAYERS)))
def test_importing_a_package_loads_nothing_above_it(index: int) -> None:
    package, above = LAYERS[index], LAYERS[index + 1 :]
    code = f"import sys, {package}; print([m for m in {above!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
