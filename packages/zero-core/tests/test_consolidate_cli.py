"""zero-consolidate as a user meets it: a damaged index or shard, or an output path it
must not write, ends in one line and exit 2, leaves no ``.partial`` behind, and never
touches the checkpoint; an output that exists is replaced only with --overwrite.

Found by probing: it once overwrote any existing file without a word (its own
checkpoint's index.json included, which destroyed the checkpoint), raised KeyError,
IndexError or AttributeError tracebacks for damaged indexes, and left OUT.partial behind
after each failure."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parity import build_engine, normalised
from test_checkpoint import CASE, run_steps

from zero_comm import Communicator, run_simulated
from zero_core import read_state_dict
from zero_core.checkpoint.consolidate import main
from zero_core.checkpoint.reader import INDEX_CHECKSUM, index_checksum


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stage 3 checkpoint of 2 ranks (two groups, a tied weight), and the model it
    consolidates to, ``good.safetensors`` beside it."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    case = normalised(CASE)

    def body(comm: Communicator) -> None:
        engine = build_engine(case, comm, 3)
        run_steps(engine, case, comm, 0, 1)
        engine.save(folder.parent, tag=folder.name)

    run_simulated(2, body)
    assert main([str(folder), str(folder.parent / "good.safetensors")]) == 0
    return folder


def consolidate_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """zero-consolidate ``argv`` in process: (exit code, stderr); argparse's exits too."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def index_paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path of a JSON value (the value itself first)."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from index_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from index_paths(item, (*path, i))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), delete=st.booleans(), replacement=JSON_VALUES, resealed=st.booleans())
def test_a_damaged_index_is_one_line_or_the_same_model(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    data: st.DataObject, delete: bool, replacement: Any, resealed: bool,
) -> None:  # fmt: skip
    """Any one key of the index deleted, or any value replaced by any JSON value: the
    model is written and equal to the undamaged one's, or the command says why in one
    line (exit 2). Never a traceback, never a ``.partial``. ``resealed``: the index's own
    checksum is recomputed after the damage (as an index from before it was recorded, or
    one edited on purpose); then a consistent edit (a tie removed) may write another
    model, but nothing is read past or short of a tensor, and nothing raises."""
    index = json.loads((saved / "index.json").read_text())
    index.pop(INDEX_CHECKSUM)
    paths = list(index_paths(index))
    path = data.draw(st.sampled_from(paths))
    damaged = copy.deepcopy(index)
    if not path:
        damaged = replacement
    else:
        holder = damaged
        for key in path[:-1]:
            holder = holder[key]
        if delete and isinstance(holder, dict):
            del holder[path[-1]]
        elif delete:
            holder.pop(path[-1])
        else:
            holder[path[-1]] = replacement
    if isinstance(damaged, dict):
        recorded = index_checksum(index)
        damaged[INDEX_CHECKSUM] = index_checksum(damaged) if resealed else recorded
    folder = tmp_path / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(saved, folder)
    (folder / "index.json").write_text(json.dumps(damaged))
    before = files_of(folder)
    out = tmp_path / "model.safetensors"
    out.unlink(missing_ok=True)
    code, err = consolidate_cli([str(folder), str(out)], capsys)
    assert files_of(folder) == before
    assert not list(tmp_path.glob("*.partial"))
    if code == 0:  # unless resealed, a change the checksum covers is named, or a no-op
        assert resealed or same_model(out, saved.parent / "good.safetensors"), path
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, (path, err)
        assert err.startswith("zero-consolidate: error: ") and "Traceback" not in err


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header", "offsets"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_damaged_shard_of_any_rank_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, rank: int
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    shard = folder / f"rank-{rank:05d}.safetensors"
    raw = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(raw[:4])
    elif damage == "garbage":
        shard.write_bytes(bytes(reversed(raw)))
    elif damage == "header":  # the header's JSON replaced by a list of the same length
        length = int.from_bytes(raw[:8], "little")
        shard.write_bytes(raw[:8] + b"[" + b" " * (length - 2) + b"]" + raw[8 + length :])
    else:  # two tensors of one size swap places: the file's size and data are unchanged
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        a, b = "master.0", "state.0.exp_avg"
        header[a]["data_offsets"], header[b]["data_offsets"] = (
            header[b]["data_offsets"], header[a]["data_offsets"],
        )  # fmt: skip
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= length
        shard.write_bytes(raw[:8] + text + b" " * (length - len(text)) + raw[8 + length :])
    code, err = consolidate_cli([str(folder), str(tmp_path / "m.safetensors")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"rank-{rank:05d}.safetensors" in err
    assert not list(tmp_path.glob("*.partial"))


def test_outputs_it_must_not_write_are_refused_in_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("notes\n")
    (tmp_path / "exists.safetensors").write_text("someone's\n")
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    before = files_of(folder)
    cases = {
        "a-folder": "is a folder: name the file to write",
        "exists.safetensors": "exists: pass --overwrite to replace it",
        "ckpt/index.json": "is inside the checkpoint",
        "ckpt/model.safetensors": "is inside the checkpoint",
        "missing/model.safetensors": "does not exist: create the folder (mkdir -p",
        "a-file/model.safetensors": "is not a folder: create the folder",
    }
    for name, message in cases.items():
        code, err = consolidate_cli([str(folder), str(tmp_path / name)], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
    assert files_of(folder) == before
    assert (tmp_path / "exists.safetensors").read_text() == "someone's\n"
    assert (tmp_path / "a-file").read_text() == "notes\n"
    assert not list(tmp_path.rglob("*.partial"))
    replace = [str(folder), str(tmp_path / "exists.safetensors"), "--overwrite"]
    assert consolidate_cli(replace, capsys)[0] == 0
    assert same_model(tmp_path / "exists.safetensors", saved.parent / "good.safetensors")


def same_model(a: Path, b: Path) -> bool:
    """The same names, dtypes, shapes and bits (the files' metadata names their source)."""
    left, right = dict(read_state_dict(a)), dict(read_state_dict(b))
    return left.keys() == right.keys() and all(
        left[k].dtype == right[k].dtype and torch.equal(left[k], right[k]) for k in left
    )


@settings(max_examples=80, deadline=None)
@given(data=st.data(), replacement=JSON_VALUES)
def test_read_state_dict_of_a_damaged_header_names_the_file(
    data: st.DataObject, replacement: Any
) -> None:
    """Any one value of a safetensors header replaced by any JSON value (a 4 TB shape, a
    negative offset, a dtype name that is not one): read_state_dict gives the same
    tensors or raises CorruptFileError naming the file; never a KeyError, a MemoryError
    or values from the wrong bytes. Found by probing: a header claiming 4 TB was allocated
    (MemoryError)."""
    import tempfile

    from zero_core.checkpoint.safetensors_file import CorruptFileError, write_file

    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.int64),
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.safetensors"
        write_file(path, list(tensors.items()))
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        name = data.draw(st.sampled_from(["a", "b"]))
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][key] = data.draw(
            st.one_of(st.just(replacement), st.just([1 << 40, 1 << 20]), st.just([-8, 0]))
        )
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
        try:
            read = dict(read_state_dict(path))
        except CorruptFileError as exc:
            assert str(path) in str(exc)
            return
        assert read.keys() == tensors.keys()
        assert all(
            read[k].dtype == tensors[k].dtype and torch.equal(read[k], tensors[k]) for k in read
        )
