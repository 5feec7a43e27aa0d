"""zero_core's folders sit on the core one way: the import graph, read from the code, has no
circle, and each folder imports only what its __init__ docstring says it may.

    config/  memory/  zero_r/   import nothing else of zero_core (everything may use them)
    checkpoint/                 only flat_layout, config/ and command_line (save and load
                                receive plain data; zero-consolidate is a command)
    offload/                    never the engine, its builder or initialize
    estimate/                   imported by nothing of the core but the package's front door
                                and plan/ (zero-plan's cost model uses its byte counts)
    plan/                       imported by nothing of the core but the package's front door

Imports inside functions count: a lazy import is an arrow all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zero_core

SRC = Path(zero_core.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """zero_core module (dotted, without 'zero_core.'; '' is the package) -> the zero_core
    modules it imports."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    full = f"{stem}.{alias.name}" if stem else alias.name
                    targets.add(full if full in modules else stem)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zero_core"):
                targets.add(node.module.removeprefix("zero_core").lstrip("."))  # type: ignore[union-attr]
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def folder_of(module: str) -> str:
    return module.split(".")[0] if "." in module else ""


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "checkpoint.tags" in graph["engine_state"]  # a module-level arrow
    assert "engine_state" in graph["engine"]  # the engine's base
    assert "config.choices" in graph["checkpoint.consolidate"]  # from a folder to another
    assert (
        "flat_layout" in graph["checkpoint.writer"] or "flat_layout" in graph["checkpoint.loader"]
    )


def test_no_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt == "":  # the front door imports everything; nothing imports it back
                continue
            if state.get(nxt) == 1:
                circle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


ALLOWED_OUTSIDE = {
    "config": set(),
    "memory": set(),
    "zero_r": set(),
    "checkpoint": {"flat_layout", "config.choices", "command_line"},  # zero-consolidate
}


@pytest.mark.parametrize("folder", sorted(ALLOWED_OUTSIDE))
def test_a_folder_imports_only_what_it_may(folder: str) -> None:
    allowed = ALLOWED_OUTSIDE[folder]
    for module, targets in import_graph().items():
        if folder_of(module) != folder:
            continue
        outside = {t for t in targets if folder_of(t) != folder and t not in allowed}
        outside -= {folder}  # the folder's own __init__
        assert not outside, f"zero_core.{module} imports {sorted(outside)}, outside {folder}/"


def test_offload_never_imports_the_engine() -> None:
    for module, targets in import_graph().items():
        if folder_of(module) == "offload":
            assert not targets & {"engine", "engine_state", "builder", "initialize"}, module


def test_only_the_front_door_and_the_planner_import_estimate() -> None:
    for module, targets in import_graph().items():
        if folder_of(module) not in ("estimate", "plan") and module != "":
            assert not {t for t in targets if folder_of(t) == "estimate"}, module


def test_only_the_front_door_and_hetero_import_the_planner() -> None:
    """hetero/ (zero-train's auto for mixed ranks) predicts a step with the planner's
    terms; the planner itself knows nothing of mixed ranks, so it never imports hetero/."""
    for module, targets in import_graph().items():
        if folder_of(module) not in ("plan", "hetero") and module not in ("", "plan"):
            assert not {t for t in targets if folder_of(t) == "plan" or t == "plan"}, module
        if folder_of(module) == "plan":
            assert not {t for t in targets if folder_of(t) == "hetero"}, module
