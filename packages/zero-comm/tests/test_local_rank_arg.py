"""zero-launch's ``--local_rank=<n>`` for scripts written for DeepSpeed's launcher (issue
46, trap 7): a script that declares the argument gets its local rank there, in the
spelling it declares; one that does not gets nothing extra (argparse would stop it on an
unknown flag); ``--local-rank-arg`` and DeepSpeed's ``--no_local_rank`` override.

The real-rank cases start ``python -m zero_comm.launch -n 2 python SCRIPT`` with scripts
that use only the standard library (about a second each); the rest are pure functions."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from test_launch import LAUNCH, _env, run_launch

from zero_comm.local_rank_arg import (
    declared_spelling,
    module_path,
    script_source,
    with_local_rank,
)

pytestmark = pytest.mark.timeout(60)

# A DeepSpeed-tutorial-shaped script: argparse with a strict parse_args, so any flag it
# does not declare ends it with exit 2; each rank writes what it read.
SCRIPT = """
import argparse, json, os, sys
parser = argparse.ArgumentParser()
{declaration}
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
rank = os.environ["RANK"]
with open(os.path.join(os.environ["TEST_DIR"], f"seen.{{rank}}"), "w") as f:
    json.dump({{"local_rank": getattr(args, "local_rank", None), "argv": sys.argv[1:],
               "env": os.environ["LOCAL_RANK"], "epochs": args.epochs}}, f)
"""
UNDERSCORE = 'parser.add_argument("--local_rank", type=int, default=-1)'
DASH = "parser.add_argument('--local-rank', type=int, default=-1)"
BOTH = 'parser.add_argument("--local-rank", "--local_rank", type=int, default=-1)'
NEITHER = "# --local_rank is not declared here (a comment is not a declaration)"


def run_script(tmp_path: Path, declaration: str, *options: str) -> list[dict[str, object]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(declaration=declaration)))
    cmd = [*LAUNCH, "-n", "2", *options, sys.executable, "-u", str(script), "--epochs", "3"]
    result = run_launch(cmd, _env(tmp_path), tmp_path)
    assert result.returncode == 0, result.stderr
    return [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    ("declaration", "spelling"),
    [(UNDERSCORE, "--local_rank"), (DASH, "--local-rank"), (BOTH, "--local_rank")],
    ids=["underscore", "dash", "both"],
)
def test_a_script_declaring_it_gets_its_local_rank(
    tmp_path: Path, declaration: str, spelling: str
) -> None:
    """Before: args.local_rank stayed -1 on both ranks (the non-distributed path)."""
    seen = run_script(tmp_path, declaration)
    assert [s["local_rank"] for s in seen] == [0, 1]
    assert [s["argv"] for s in seen] == [[f"{spelling}={r}", "--epochs", "3"] for r in (0, 1)]
    assert [s["env"] for s in seen] == ["0", "1"]
    assert [s["epochs"] for s in seen] == [3, 3]


def test_a_script_not_declaring_it_gets_nothing_extra(tmp_path: Path) -> None:
    seen = run_script(tmp_path, NEITHER)
    assert [s["argv"] for s in seen] == [["--epochs", "3"]] * 2
    assert [s["env"] for s in seen] == ["0", "1"]


@pytest.mark.parametrize("option", [["--no_local_rank"], ["--local-rank-arg", "never"]])
def test_never_leaves_a_declaring_script_at_its_default(tmp_path: Path, option: list[str]) -> None:
    seen = run_script(tmp_path, UNDERSCORE, *option)
    assert [s["local_rank"] for s in seen] == [-1, -1]


def test_always_gives_it_to_a_script_whose_parser_is_elsewhere(tmp_path: Path) -> None:
    """The parser is built in a module beside the script, which auto does not read: the
    script's own source declares nothing, so only ``always`` gives it."""
    (tmp_path / "options.py").write_text(
        textwrap.dedent(SCRIPT.format(declaration=UNDERSCORE))
        .replace("args = parser.parse_args()", "def parse():\n    return parser.parse_args()")
        .split("rank = os.environ")[0]
    )
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "sys.path.insert(0, os.path.dirname(__file__))\n"
        "import options\n"
        "args = options.parse()\n"
        "with open(os.path.join(os.environ['TEST_DIR'], 'seen.' + os.environ['RANK']), 'w') as f:\n"
        "    json.dump({'local_rank': args.local_rank}, f)\n"
    )
    for mode, expected in (("auto", [-1, -1]), ("always", [0, 1])):
        cmd = [*LAUNCH, "-n", "2", "--local-rank-arg", mode, sys.executable, str(script)]
        result = run_launch(cmd, _env(tmp_path), tmp_path)
        assert result.returncode == 0, result.stderr
        seen = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]
        assert [s["local_rank"] for s in seen] == expected, mode


def test_an_unknown_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from zero_comm.launch import main

    with pytest.raises(SystemExit) as info:
        main(["-n", "2", "--local-rank-arg", "sometimes", "true"])
    assert info.value.code == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


# ------------------------------------------------------------------ pure functions


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (UNDERSCORE, "--local_rank"),
        (DASH, "--local-rank"),
        (BOTH, "--local_rank"),
        (NEITHER, None),
        ("parser.add_argument('--local_rank_offset')", None),
        ("", None),
    ],
)
def test_declared_spelling(source: str, expected: str | None) -> None:
    assert declared_spelling(source) == expected


def test_where_the_flag_goes_in_each_form_of_command(tmp_path: Path) -> None:
    """Right after the script, before its arguments, as DeepSpeed's and torch's launchers
    put it; python's own options (-u, -W x) stay before the script."""
    script = tmp_path / "s.py"
    script.write_text(UNDERSCORE)
    py = sys.executable
    assert with_local_rank([py, "-u", "-W", "error", str(script), "--x"], 1, "auto") == [
        py, "-u", "-W", "error", str(script), "--local_rank=1", "--x"]  # fmt: skip
    assert with_local_rank(["python3", "-c", DASH, "a"], 0, "auto") == [
        "python3", "-c", DASH, "--local-rank=0", "a"]  # fmt: skip
    shebang = tmp_path / "run"
    shebang.write_text(f"#!{py}\n{UNDERSCORE}\n")
    shebang.chmod(0o755)
    assert with_local_rank([str(shebang), "b"], 1, "auto") == [str(shebang), "--local_rank=1", "b"]
    assert with_local_rank(["true", "c"], 1, "auto") == ["true", "c"]
    assert with_local_rank(["true", "c"], 1, "always") == ["true", "--local_rank=1", "c"]
    assert with_local_rank([py, str(script)], 1, "never") == [py, str(script)]
    # Already given by the user: theirs is kept, not a second one.
    given = [py, str(script), "--local_rank", "5"]
    assert with_local_rank(given, 1, "auto") == given
    assert with_local_rank([py, "-"], 1, "auto") == [py, "-"]  # stdin: nothing to read


def test_a_module_is_found_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m pkg.train``: pkg's __init__ is never run (it could import torch)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "train.py").write_text(DASH)
    (package / "__main__.py").write_text(UNDERSCORE)
    monkeypatch.chdir(tmp_path)
    assert module_path("pkg.train") == package / "train.py"
    assert module_path("pkg") == package / "__main__.py"
    assert module_path("pkg.missing") is None
    assert "pkg" not in sys.modules
    assert with_local_rank(["python", "-m", "pkg.train", "x"], 1, "auto") == [
        "python", "-m", "pkg.train", "--local-rank=1", "x"]  # fmt: skip
    assert with_local_rank(["python", "-m", "pkg"], 0, "auto")[-1] == "--local_rank=0"
    assert script_source(["python", "-m", "nosuchmodule_xyz"]) is None
