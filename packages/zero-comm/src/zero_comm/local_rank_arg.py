"""The ``--local_rank=<n>`` argument that DeepSpeed's launcher gives a script, for
zero-launch: given to the scripts that declare it, and to no other.

Scripts written for DeepSpeed's launcher (and for ``python -m torch.distributed.launch``)
declare ``parser.add_argument("--local_rank", type=int, default=-1)`` and read
``args.local_rank``; at -1 they take the non-distributed path (a plain sampler), and
every rank then reads the whole data set without a word. Those launchers put the flag
right after the script, before the script's own arguments:

    deepspeed train.py --epochs 2        ->  python -u train.py --local_rank=0 --epochs 2
    python -m torch.distributed.launch   ->  python -u train.py --local-rank=0 ...
    torchrun                             ->  nothing (LOCAL_RANK in the environment only)

DeepSpeed always adds it (``--no_local_rank`` turns that off), so a script that does not
declare it stops with argparse's "unrecognized arguments". zero-launch, which also starts
zero-train and any other program, adds it only where it can be read. With ``auto`` (the
default) it reads the Python source each rank will run (``python [opts] SCRIPT``, ``python
-c CODE``, ``python -m MODULE`` found on the path without importing it, or an executable
file whose ``#!`` line names python) and adds the spelling that source declares, as a
quoted string: ``"--local_rank"`` (DeepSpeed's, preferred when both are there) or
``"--local-rank"`` (torch's since 2.0). Nothing is added to a command whose source it
cannot read or that declares neither, nor when the command already passes one itself.
``always`` adds ``--local_rank=<n>`` whatever the source says (a script whose parser is
built in another module), ``never`` adds nothing. LOCAL_RANK is in every rank's
environment in all three cases.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Literal, NamedTuple

LocalRankMode = Literal["auto", "always", "never"]
MODES: tuple[LocalRankMode, ...] = ("auto", "always", "never")
DEEPSPEED_SPELLING = "--local_rank"
TORCH_SPELLING = "--local-rank"
# The flag as a quoted string of the source: an argparse declaration ("--local_rank",
# '--local-rank'), not a word in a comment or a docstring's prose.
_DECLARED = {
    spelling: re.compile(rf"""(['"]){re.escape(spelling)}\1""")
    for spelling in (DEEPSPEED_SPELLING, TORCH_SPELLING)
}
_PYTHON = re.compile(r"^python[0-9.]*$")
_MAX_SOURCE_BYTES = 4 << 20  # a script larger than this is not read (auto adds nothing)
# Interpreter options followed by a value of their own (python -W error -X dev script.py).
_OPTIONS_WITH_VALUE = ("-W", "-X")


class ScriptSource(NamedTuple):
    """The Python source a command runs, and where in the command its arguments begin."""

    text: str
    arguments_at: int  # index in the command of the script's first argument


def with_local_rank(command: Sequence[str], local_rank: int, mode: LocalRankMode) -> list[str]:
    """``command`` as local rank ``local_rank`` runs it under ``mode`` (see the module doc):
    with ``--local_rank=<n>`` (or ``--local-rank=<n>``) right after the script, where the
    DeepSpeed and torch launchers put it, or unchanged."""
    if mode not in MODES:
        raise ValueError(f"--local-rank-arg {mode!r}: choose one of {', '.join(MODES)}")
    command = list(command)
    if mode == "never":
        return command
    source = script_source(command)
    at = source.arguments_at if source is not None else min(1, len(command))
    if any(arg.split("=")[0] in _DECLARED for arg in command[at:]):
        return command  # the user passes it already: theirs is kept, never a second
    spelling = declared_spelling(source.text) if source is not None else None
    if spelling is None and mode == "always":
        spelling = DEEPSPEED_SPELLING
    if spelling is None:
        return command
    return [*command[:at], f"{spelling}={local_rank}", *command[at:]]


def declared_spelling(source: str) -> str | None:
    """The local-rank flag ``source`` declares: DeepSpeed's ``--local_rank`` where it
    names that one (alone or beside torch's), torch's ``--local-rank`` where it names only
    that one, else None."""
    for spelling in (DEEPSPEED_SPELLING, TORCH_SPELLING):
        if _DECLARED[spelling].search(source):
            return spelling
    return None


def script_source(command: Sequence[str]) -> ScriptSource | None:
    """The Python source ``command`` runs, or None where it is not a Python script this
    process can read (a binary, ``python -`` reading stdin, a module not on the path)."""
    if not command:
        return None
    program = Path(command[0]).name
    if _PYTHON.match(program):
        return _interpreter_source(command)
    found = shutil.which(command[0])
    if found is None:
        return None
    text = _read(Path(found))
    first_line = text.split("\n", 1)[0] if text else ""
    if first_line.startswith("#!") and "python" in first_line:
        return ScriptSource(text, 1)
    return None


def _interpreter_source(command: Sequence[str]) -> ScriptSource | None:
    i = 1
    while i < len(command):
        arg = command[i]
        if arg == "-c" and i + 1 < len(command):
            return ScriptSource(command[i + 1], i + 2)
        if arg == "-m" and i + 1 < len(command):
            path = module_path(command[i + 1])
            text = _read(path) if path is not None else ""
            return ScriptSource(text, i + 2) if text else None
        if arg in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if arg == "-" or arg == "--":
            return None if arg == "-" else _script_at(command, i + 1)
        if arg.startswith("-"):
            i += 1  # -u, -B, -O, -uB, -Wdefault: flags (and glued values) of python's own
            continue
        return _script_at(command, i)
    return None


def _script_at(command: Sequence[str], i: int) -> ScriptSource | None:
    if i >= len(command):
        return None
    text = _read(Path(command[i]))
    return ScriptSource(text, i + 1) if text else None


def module_path(name: str) -> Path | None:
    """The file ``python -m name`` runs (a package's ``__main__.py``), found on the
    working folder and this interpreter's path without importing anything (a package's
    ``__init__`` may import torch); None where it is not found that way."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is None:
        return None
    if spec.submodule_search_locations:
        mains = [Path(d) / "__main__.py" for d in spec.submodule_search_locations]
        return next((m for m in mains if m.is_file()), None)
    return Path(spec.origin) if spec.origin and spec.has_location else None


def _read(path: Path) -> str:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_SOURCE_BYTES:
            return ""
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return ""
