"""``zero-consolidate CKPT OUT``: a sharded checkpoint to one plain safetensors state dict.

    zero-consolidate runs/zero-train/checkpoint model.safetensors [--dtype bf16]
    model.load_state_dict(dict(zero_core.read_state_dict("model.safetensors")))

Streams parameter by parameter: each full value is assembled from the byte ranges of the
shards that hold its pieces, written, and dropped, so memory is bounded by the largest
tensor, not the model. Works for checkpoints of any world size and stage.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..command_line import CommandLineParser
from ..config.choices import SHORT_DTYPE_NAMES
from .format import CheckpointError
from .reader import CheckpointReader
from .safetensors_file import CorruptFileError, write_stream

DTYPES = SHORT_DTYPE_NAMES


class SavedModel(CheckpointReader):
    """The logical contents of a checkpoint: full parameters (float32 masters, or any
    sharded optimizer state) and whole tensors, read one at a time."""

    def parameters(self) -> list[tuple[int, int, str, list[int]]]:
        """(group, index in group, name, shape) of every trainable parameter."""
        return [
            (g, i, name, shape)
            for g, group in enumerate(self.index["groups"])
            for i, (name, shape) in enumerate(group["params"])
        ]

    def whole_names(self) -> list[str]:
        return [n.removeprefix("whole.") for n in self.file_of(0).names if n.startswith("whole.")]

    def parameter(self, group: int, index: int, what: str = "master") -> torch.Tensor:
        """Parameter ``index`` of ``group``, full: its float32 master, or with ``what`` an
        optimizer state key (``exp_avg``), from every shard holding a piece of it."""
        shape = self.parameters_of(group)[index][3]
        numel = math.prod(shape)
        tensor_name = f"master.{group}" if what == "master" else f"state.{group}.{what}"
        try:
            value = self.read_whole(group, index, numel, tensor_name)
        except CorruptFileError as exc:
            raise CheckpointError(f"checkpoint {self.folder}: {exc}") from exc
        return value.view(shape)

    def parameters_of(self, group: int) -> list[tuple[int, int, str, list[int]]]:
        return [entry for entry in self.parameters() if entry[0] == group]

    def state_dict(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) like ``model.state_dict()``: trainable parameters (tied ones
        under each name), then frozen parameters and buffers; one tensor at a time."""
        by_name = {name: (g, i) for g, i, name, _ in self.parameters()}
        for name, (g, i) in by_name.items():
            yield name, self.parameter(g, i).to(dtype)
        for alias, name in self.index.get("aliases", {}).items():
            g, i = by_name[name]
            yield alias, self.parameter(g, i).to(dtype)
        for name in self.whole_names():
            value = self.file_of(0).read(f"whole.{name}")
            yield name, value.to(dtype) if value.is_floating_point() else value

    def specs(self, dtype: torch.dtype) -> list[tuple[str, torch.dtype, list[int]]]:
        """What :meth:`state_dict` yields, without reading any value."""
        shapes = {name: shape for _, _, name, shape in self.parameters()}
        out = [(name, dtype, shape) for name, shape in shapes.items()]
        aliases = self.index.get("aliases", {})
        out += [(alias, dtype, shapes[name]) for alias, name in aliases.items()]
        for name in self.whole_names():
            saved_dtype, shape, _, _ = self.file_of(0).entry(f"whole.{name}")
            out.append((name, dtype if saved_dtype.is_floating_point else saved_dtype, shape))
        return out


def consolidate(checkpoint: str | Path, out: str | Path, dtype: torch.dtype) -> int:
    """Write the checkpoint's full model to ``out`` (safetensors); returns its bytes."""
    saved = SavedModel(checkpoint)
    if saved.headers_unchecked:
        print(f"zero-consolidate: note: {saved.headers_unchecked}", file=sys.stderr)
    written = write_stream(Path(out), saved.specs(dtype), (t for _, t in saved.state_dict(dtype)),
                           {"format": "pt", "source": str(saved.folder)})  # fmt: skip
    return written.bytes


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandLineParser(prog="zero-consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a directory written by engine.save()")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    problem = output_problem(args.checkpoint, args.out, args.overwrite)
    if problem:
        parser.error(problem)
    try:
        size = consolidate(args.checkpoint, args.out, DTYPES[args.dtype])
    except (CheckpointError, CorruptFileError, OSError) as exc:
        print(f"zero-consolidate: error: {exc}", file=sys.stderr)
        return 2
    print(f"zero-consolidate: wrote {args.out} ({size / 2**20:.1f} MiB, {args.dtype})")
    return 0


def output_problem(checkpoint: Path, out: Path, overwrite: bool) -> str:
    """Why ``out`` cannot be written ("" if it can): a folder, an existing file (without
    ``overwrite``), a path inside the checkpoint, or a parent that is not a folder."""
    if out.is_dir():
        return f"{out} is a folder: name the file to write, e.g. {out / 'model.safetensors'}"
    if checkpoint.is_dir() and checkpoint.resolve() in out.resolve().parents:
        return f"{out} is inside the checkpoint {checkpoint}: write the model elsewhere"
    if out.exists() and not overwrite:
        return f"{out} exists: pass --overwrite to replace it, or name another file"
    parent = out.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        return f"{parent} {what}: create the folder (mkdir -p {parent}) or name another file"
    return ""


if __name__ == "__main__":
    sys.exit(main())
