"""safetensors_file.write_stream with chunked values: a tensor given as its pieces writes
the file, checksums included, byte for byte as the joined tensor does; pieces that do not
add up to the declared tensor are refused and leave no file."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.checkpoint.safetensors_file import write_file, write_stream

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    cuts=st.lists(st.lists(st.integers(0, 300), max_size=5), min_size=4, max_size=4),
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from([8, 24, 64, 1 << 20]),
)
def test_chunks_write_the_joined_tensors_file(
    sizes: list[int], cuts: list[list[int]], dtype: torch.dtype, block: int
) -> None:
    generator = torch.Generator().manual_seed(sum(sizes))
    tensors = [
        (f"t{i}", torch.randint(0, 100, (n,), generator=generator).to(dtype))
        for i, n in enumerate(sizes)
    ]
    values: list[torch.Tensor | list[torch.Tensor]] = []
    for (_, tensor), at in zip(tensors, cuts, strict=False):
        edges = sorted({0, tensor.numel(), *(min(c, tensor.numel()) for c in at)})
        values.append([tensor[a:b] for a, b in itertools.pairwise(edges)])
    with tempfile.TemporaryDirectory() as folder:
        joined, chunked = Path(folder) / "joined", Path(folder) / "chunked"
        a = write_file(joined, tensors, {"format": "x"}, block)
        specs = [(name, t.dtype, list(t.shape)) for name, t in tensors]
        b = write_stream(chunked, specs, values, {"format": "x"}, block)
        assert joined.read_bytes() == chunked.read_bytes()
        assert a == b


def test_chunks_that_do_not_make_the_declared_tensor_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    spec = [("t", torch.float32, [5])]
    with pytest.raises(ValueError, match=r"chunks hold 4 elements, declared \(5,\)"):
        write_stream(path, spec, [[torch.zeros(2), torch.zeros(2)]])
    with pytest.raises(ValueError, match=r"a chunk is torch\.float16, declared torch\.float32"):
        write_stream(path, spec, [[torch.zeros(2), torch.zeros(3, dtype=torch.float16)]])
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing left behind
