"""Port a script written for DeepSpeed to zero_core.deepspeed by changing its imports only.

    ported = port(Path("cifar10_deepspeed.py"), out_dir)   # out_dir/cifar10_deepspeed.py

Each line in ``IMPORTS`` is replaced by its zero_core form; every other line must come out
exactly as it went in, and the copy must name DeepSpeed nowhere but in those imports: this
is issue 46's promise ("a script written for DeepSpeed runs after changing only its
imports"), checked rather than assumed. A script that imports more of DeepSpeed than these
lines (``from deepspeed.ops.adam import FusedAdam``) is refused, naming the line.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

# DeepSpeed's import line -> ours. Nothing else in a script may change.
IMPORTS = {
    "import deepspeed": "import zero_core.deepspeed as deepspeed",
    "from deepspeed.accelerator import get_accelerator": (
        "from zero_core.deepspeed.accelerator import get_accelerator"
    ),
}
# A line that reaches DeepSpeed's package by name (not the ``deepspeed.`` attribute calls
# made through the imported module, which the facade answers).
NAMES_THE_PACKAGE = re.compile(r"^\s*(import\s+deepspeed\b|from\s+deepspeed\b)")


def ported_text(original: str) -> str:
    """``original`` with each DeepSpeed import line replaced by zero_core's."""
    lines = original.splitlines(keepends=True)
    out = []
    for number, line in enumerate(lines, 1):
        stripped = line.rstrip("\n")
        if stripped in IMPORTS:
            out.append(IMPORTS[stripped] + line[len(stripped) :])
        elif NAMES_THE_PACKAGE.match(stripped):
            raise ValueError(
                f"line {number} imports DeepSpeed in a way port.py does not rewrite: "
                f"{stripped!r}; only {sorted(IMPORTS)} have zero_core forms"
            )
        else:
            out.append(line)
    return "".join(out)


def changed_lines(original: str, ported: str) -> list[tuple[str, str]]:
    """(old, new) for each line that differs; the two texts must have equal line counts."""
    old, new = original.splitlines(), ported.splitlines()
    if len(old) != len(new):
        diff = "".join(difflib.unified_diff(old, new, lineterm="\n"))
        raise AssertionError(f"the port added or removed lines:\n{diff}")
    return [(a, b) for a, b in zip(old, new, strict=True) if a != b]


def port(script: Path, out_dir: Path) -> Path:
    """Write ``out_dir/<script's name>``, the port of ``script``; return its path.

    Raises AssertionError if anything but the import lines of ``IMPORTS`` differs, or if
    none of them was found (then the script is not DeepSpeed's and the port proves nothing).
    """
    original = script.read_text()
    ported = ported_text(original)
    changes = changed_lines(original, ported)
    unexpected = [(a, b) for a, b in changes if IMPORTS.get(a) != b]
    assert not unexpected, f"{script.name}: lines other than the imports changed: {unexpected}"
    assert changes, f"{script.name} has none of the imports {sorted(IMPORTS)}: nothing to port"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / script.name
    target.write_text(ported)
    return target
