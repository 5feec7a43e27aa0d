"""The swap file as a spec: bytes round-trip exactly, damage is named, no room is named.

Sizes are small and deliberately awkward (not multiples of 4096, tensors one element off an
aligned address) so every path is taken: whole pages straight from the tensor, the last
partial page through the staging page, unaligned tensors through the staging buffer,
buffered I/O where O_DIRECT is refused. Round trips compare bytes (``torch.equal`` of uint8
views), so random bit patterns that are NaN as floats still compare.

The mount tests need root (they mount small tmpfs instances) and skip with the reason
otherwise; every mount is unmounted in a ``finally``.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_core.offload import swap_file
from zero_core.offload.swap_file import (
    ALIGNMENT,
    HUGE_PAGE,
    STAGING_BYTES,
    CorruptSwapError,
    SwapError,
    SwapFile,
    SwapSpaceError,
    aligned_empty,
    check_offload_dir,
    padded_bytes,
)

MIB = 2**20
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def random_tensor(numel: int, dtype: torch.dtype, seed: int, misalign: int = 0) -> torch.Tensor:
    """``numel`` random-bit elements; ``misalign`` elements past an aligned address."""
    base = aligned_empty(numel + misalign, dtype)
    out = base[misalign:]
    gen = torch.Generator().manual_seed(seed)
    raw = out.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
    return out


def empty_like(t: torch.Tensor, misalign: int = 0) -> torch.Tensor:
    out = aligned_empty(t.numel() + misalign, t.dtype)[misalign:]
    out.view(torch.uint8).fill_(0xA5)  # not zeros: a read that does nothing must not pass
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def can_open_direct(folder: Path) -> bool:
    probe = folder / "direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


@contextmanager
def tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``folder`` with ``options``; skips the test where mounting is not
    permitted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} is not permitted here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False)


# -- pure functions ----------------------------------------------------------------------


@given(st.integers(0, 10 * ALIGNMENT))
def test_padded_bytes_is_the_next_multiple_of_alignment(n: int) -> None:
    p = padded_bytes(n)
    assert p % ALIGNMENT == 0
    assert n <= p < n + ALIGNMENT


@given(st.integers(0, 3 * ALIGNMENT), st.sampled_from([*DTYPES, torch.uint8, torch.float64]))
def test_aligned_empty_is_aligned_and_its_storage_covers_the_padded_length(
    numel: int, dtype: torch.dtype
) -> None:
    t = aligned_empty(numel, dtype)
    assert (t.numel(), t.dtype, t.dim(), t.device.type) == (numel, dtype, 1, "cpu")
    assert t.data_ptr() % ALIGNMENT == 0
    storage = t.untyped_storage()
    extent = storage.data_ptr() + storage.nbytes() - t.data_ptr()
    assert extent >= padded_bytes(numel * t.element_size())


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_buffers_are_huge_page_aligned_advised_and_outlive_their_mapping() -> None:
    t = aligned_empty(HUGE_PAGE // 4 + 3, torch.float32)
    assert t.data_ptr() % HUGE_PAGE == 0
    storage = t.untyped_storage()
    assert storage.data_ptr() + storage.nbytes() - t.data_ptr() >= padded_bytes(t.numel() * 4)
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "hg" in vm_flags(t.data_ptr())  # MADV_HUGEPAGE applied
    view = t[5:]
    del t, storage
    gc.collect()
    view.fill_(2.0)  # the mapping lives as long as a view of it
    assert view.sum().item() == 2.0 * (HUGE_PAGE // 4 - 2)


# -- round trips -------------------------------------------------------------------------


@settings(max_examples=60)
@given(
    dtype=st.sampled_from(DTYPES),
    numels=st.tuples(st.integers(0, 3000), st.integers(1, 3000)),
    misalign=st.tuples(st.sampled_from([0, 1, 3]), st.sampled_from([0, 1, 3])),
    direct=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_bytewise_exact(
    dtype: torch.dtype,
    numels: tuple[int, int],
    misalign: tuple[int, int],
    direct: bool,
    seed: int,
) -> None:
    """Two neighbouring blocks, each of any size and alignment, read back in reverse order:
    the padding of the first must not reach into the second."""
    first = random_tensor(numels[0], dtype, seed, misalign[0])
    second = random_tensor(numels[1], dtype, seed + 1, misalign[1])
    size_a = padded_bytes(first.numel() * first.element_size())
    size_b = padded_bytes(second.numel() * second.element_size())
    with (
        tempfile.TemporaryDirectory(dir="/tmp") as folder,
        SwapFile(Path(folder) / "swap", size_a + size_b + 1, direct=direct) as f,
    ):
        f.write(0, first, "a")
        f.write(size_a, second, "b")
        back_b, back_a = empty_like(second, misalign[0]), empty_like(first, misalign[1])
        f.read(size_a, back_b, "b")
        f.read(0, back_a, "a")
    assert same_bytes(back_a, first)
    assert same_bytes(back_b, second)


@pytest.mark.parametrize("direct", [True, False])
def test_a_block_larger_than_the_staging_buffer_round_trips_unaligned(
    tmp_path: Path, direct: bool
) -> None:
    t = random_tensor((STAGING_BYTES + 3 * ALIGNMENT + 100) // 4, torch.float32, 7, misalign=1)
    with SwapFile(tmp_path / "swap", 2 * STAGING_BYTES, direct=direct) as f:
        f.write(ALIGNMENT, t, "big")
        back = empty_like(t, misalign=3)
        f.read(ALIGNMENT, back, "big")
    assert same_bytes(back, t)


def test_reading_into_a_view_does_not_touch_the_rest_of_its_storage(tmp_path: Path) -> None:
    """An aligned view of 1000 floats lies in a flat buffer whose next elements belong to
    someone else: a padded 4096-byte read straight into the view would overwrite them."""
    flat = aligned_empty(2048, torch.float32)
    flat.copy_(torch.arange(2048, dtype=torch.float32))
    neighbours = flat[1000:].clone()
    with SwapFile(tmp_path / "swap", 2 * ALIGNMENT) as f:
        f.write(0, torch.full((1000,), -1.0), "view")
        f.read(0, flat[:1000], "view")
    assert torch.equal(flat[:1000], torch.full((1000,), -1.0))
    assert torch.equal(flat[1000:], neighbours)


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path: Path) -> None:
    if not can_open_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with SwapFile(tmp_path / "swap", ALIGNMENT) as f:
        assert f.direct
    with SwapFile(tmp_path / "swap", ALIGNMENT, direct=False) as f:
        assert not f.direct


def test_a_filesystem_that_refuses_o_direct_falls_back_to_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs refused O_DIRECT with EINVAL before Linux 6.6; newer kernels accept it, so the
    refusal is simulated."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def refuse_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    t = random_tensor(1500, torch.bfloat16, 3)
    with SwapFile(tmp_path / "swap", ALIGNMENT) as f:
        assert not f.direct
        f.write(0, t, "x")
        back = empty_like(t)
        f.read(0, back, "x")
    assert same_bytes(back, t)


def test_a_real_tmpfs_round_trips_whichever_mode_it_allows(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "mnt", "size=1m") as folder,
        SwapFile(folder / "swap", 4 * ALIGNMENT) as f,
    ):
        t = random_tensor(2500, torch.float32, 5)
        f.write(ALIGNMENT, t, "x")
        back = empty_like(t)
        f.read(ALIGNMENT, back, "x")
        assert same_bytes(back, t)


@pytest.mark.parametrize("limit", [1000, 3 * ALIGNMENT])
@pytest.mark.parametrize("direct", [True, False])
def test_short_writes_and_reads_are_continued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, limit: int
) -> None:
    """Every pwritev/preadv reports at most ``limit`` bytes moved (having moved them all: the
    kernel cannot be made to stop early, and moving a byte twice is harmless), so the caller
    must continue from there; 1000 leaves O_DIRECT at an unaligned position, which must be
    finished with buffered I/O."""
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def short_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        return min(limit, real_pwritev(fd, buffers, offset))

    def short_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        return min(limit, real_preadv(fd, buffers, offset))

    t = random_tensor(5 * ALIGNMENT // 4 + 7, torch.float32, 11)
    with SwapFile(tmp_path / "swap", 4 * padded_bytes(t.numel() * 4), direct=direct) as f:
        monkeypatch.setattr(os, "pwritev", short_pwritev)
        monkeypatch.setattr(os, "preadv", short_preadv)
        f.write(0, t, "x")
        f.write(padded_bytes(t.numel() * 4), t[1:], "unaligned")
        back, back_unaligned = empty_like(t), empty_like(t[1:], misalign=1)
        f.read(0, back, "x")
        f.read(padded_bytes(t.numel() * 4), back_unaligned, "unaligned")
    assert same_bytes(back, t)
    assert same_bytes(back_unaligned, t[1:])


@pytest.mark.parametrize("direct", [True, False])
def test_disjoint_blocks_move_concurrently_from_a_thread_pool(tmp_path: Path, direct: bool) -> None:
    sizes = [(i * 997) % 9000 + 1 for i in range(32)]  # awkward, distinct
    tensors = [random_tensor(n, DTYPES[i % 3], i, misalign=i % 2) for i, n in enumerate(sizes)]
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += padded_bytes(t.numel() * t.element_size())
    backs = [empty_like(t, misalign=(i + 1) % 2) for i, t in enumerate(tensors)]
    with SwapFile(tmp_path / "swap", at, direct=direct) as f, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: f.write(offsets[i], tensors[i], f"b{i}"), range(32)))
        list(pool.map(lambda i: f.read(offsets[i], backs[i], f"b{i}"), reversed(range(32))))
    for i, (t, back) in enumerate(zip(tensors, backs, strict=True)):
        assert same_bytes(back, t), f"block b{i}"


# -- damage ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_a_flipped_byte_is_named_with_its_block_and_both_checksums(
    tmp_path: Path, direct: bool
) -> None:
    t = random_tensor(3000, torch.float32, 1)
    with SwapFile(tmp_path / "swap", 4 * ALIGNMENT, direct=direct) as f:
        f.write(ALIGNMENT, t, "layer3.exp_avg")
        with open(f.path, "r+b") as raw:
            raw.seek(ALIGNMENT + 5000)
            byte = raw.read(1)
            raw.seek(ALIGNMENT + 5000)
            raw.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptSwapError) as caught:
            f.read(ALIGNMENT, empty_like(t), "layer3.exp_avg")
    message = str(caught.value)
    for part in ["'layer3.exp_avg'", f"offset {ALIGNMENT}", str(f.path), "expected", "crc32"]:
        assert part in message
    assert "resume from the last checkpoint" in message


def test_a_changed_byte_in_the_padding_is_not_an_error(tmp_path: Path) -> None:
    """Only the tensor's own bytes are checksummed; the padding after them is not data."""
    t = random_tensor(1000, torch.float32, 2)  # 4000 bytes: 96 bytes of padding
    with SwapFile(tmp_path / "swap", ALIGNMENT) as f:
        f.write(0, t, "x")
        with open(f.path, "r+b") as raw:
            raw.seek(4050)
            raw.write(b"\xff")
        back = empty_like(t)
        f.read(0, back, "x")
    assert same_bytes(back, t)


@pytest.mark.parametrize("keep", [0, ALIGNMENT, ALIGNMENT + 5000])
@pytest.mark.parametrize("direct", [True, False])
def test_a_truncated_file_is_a_short_read(tmp_path: Path, direct: bool, keep: int) -> None:
    t = random_tensor(3000, torch.float32, 4)  # 12000 bytes at offset 4096
    with SwapFile(tmp_path / "swap", 4 * ALIGNMENT, direct=direct) as f:
        f.write(ALIGNMENT, t, "x")
        os.truncate(f.path, keep)
        with pytest.raises(CorruptSwapError, match=r"short read of block 'x' at offset 4096"):
            f.read(ALIGNMENT, empty_like(t), "x")


def test_reading_a_block_never_written_is_refused(tmp_path: Path) -> None:
    with SwapFile(tmp_path / "swap", ALIGNMENT) as f:
        f.write(0, torch.ones(10), "written")
        with pytest.raises(CorruptSwapError, match=r"block 'other' has no checksum.*never written"):
            f.read(0, torch.empty(10), "other")


def test_a_read_must_match_the_offset_and_length_written(tmp_path: Path) -> None:
    with SwapFile(tmp_path / "swap", 2 * ALIGNMENT) as f:
        f.write(0, torch.ones(10), "x")
        with pytest.raises(ValueError, match="written at offset 0 with 40 bytes"):
            f.read(ALIGNMENT, torch.empty(10), "x")
        with pytest.raises(ValueError, match="written at offset 0 with 40 bytes"):
            f.read(0, torch.empty(11), "x")


def test_offsets_must_be_aligned_and_inside_the_reservation(tmp_path: Path) -> None:
    with SwapFile(tmp_path / "swap", 2 * ALIGNMENT) as f:
        with pytest.raises(ValueError, match="multiples of ALIGNMENT"):
            f.write(100, torch.ones(10), "x")
        with pytest.raises(ValueError, match="past the 8192 bytes reserved"):
            f.write(ALIGNMENT, torch.ones(ALIGNMENT // 4 + 1), "x")
        with pytest.raises(ValueError, match="not contiguous"):
            f.write(0, torch.ones(4, 4).t(), "x")


# -- no room, and failing disks --------------------------------------------------------


def test_check_offload_dir_accepts_a_writable_folder_with_room(tmp_path: Path) -> None:
    assert check_offload_dir(tmp_path, 1) == tmp_path.resolve()
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_check_offload_dir_refuses_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist: create it \(mkdir -p"):
        check_offload_dir(tmp_path / "nope", 0)


def test_check_offload_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        check_offload_dir(tmp_path / "file", 0)


def test_check_offload_dir_refuses_a_read_only_filesystem(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "ro", "ro,size=1m") as folder,
        pytest.raises(ValueError, match="read-only filesystem: remount it read-write"),
    ):
        check_offload_dir(folder, 0)


def test_check_offload_dir_reads_the_read_only_flag_of_the_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """statvfs's ST_RDONLY alone refuses the folder (root's probe write could still pass on
    some filesystems); simulated on a writable folder."""
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, st: os.statvfs_result) -> None:
            self.st = st
            self.f_flag = st.f_flag | os.ST_RDONLY

        def __getattr__(self, name: str) -> Any:
            return getattr(self.st, name)

    monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly(real_statvfs(path)))
    with pytest.raises(ValueError, match="read-only filesystem"):
        check_offload_dir(tmp_path, 0)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_check_offload_dir_really_tries_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Root ignores mode bits and a filesystem can turn read-only after mount, so the probe
    file decides; simulated because as root neither happens on a healthy disk."""
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if ".zero-swap-probe" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    fix = "read-only filesystem" if code == errno.EROFS else "not writable.*chmod"
    with pytest.raises(ValueError, match=fix):
        check_offload_dir(tmp_path, 0)


def test_check_offload_dir_names_the_bytes_needed_and_available(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=1m") as folder:
        with pytest.raises(SwapSpaceError) as caught:
            check_offload_dir(folder, 10 * MIB)
        available = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    message = str(caught.value)
    assert f"need {10 * MIB} bytes (0.01 GiB)" in message
    assert f"{available} bytes" in message
    assert str(folder) in message
    assert "larger disk" in message


def test_a_swap_file_that_does_not_fit_is_refused_at_creation_and_removed(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "small", "size=1m") as folder:
        with pytest.raises(SwapSpaceError, match=f"need {10 * MIB} bytes") as caught:
            SwapFile(folder / "swap", 10 * MIB)
        assert str(folder) in str(caught.value)
        assert not (folder / "swap").exists()


def fail_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fail(*args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwritev", fail)
    monkeypatch.setattr(os, "pwrite", fail)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_that_runs_out_of_space_names_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    with SwapFile(tmp_path / "swap", 2 * ALIGNMENT) as f:
        f.write(0, torch.ones(10), "x")
        fail_writes(monkeypatch, code)
        with pytest.raises(SwapSpaceError) as caught:
            f.write(0, torch.ones(10), "x")
        message = str(caught.value)
        assert str(tmp_path.absolute()) in message
        assert "the block needs 4096 bytes" in message
        # The old checksum is dropped: the bytes on disk are neither old nor new.
        with pytest.raises(CorruptSwapError, match="last write failed"):
            f.read(0, torch.empty(10), "x")


def test_other_write_errors_name_the_file_offset_and_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SwapFile(tmp_path / "swap", 2 * ALIGNMENT) as f:
        fail_writes(monkeypatch, errno.EIO)
        with pytest.raises(SwapError) as caught:
            f.write(ALIGNMENT, torch.ones(10), "x")
    assert not isinstance(caught.value, SwapSpaceError)
    message = str(caught.value)
    assert f"offset {ALIGNMENT} of {tmp_path / 'swap'}" in message
    assert os.strerror(errno.EIO) in message


def test_read_errors_name_the_file_offset_and_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with SwapFile(tmp_path / "swap", ALIGNMENT) as f:
        f.write(0, torch.ones(10), "x")
        monkeypatch.setattr(os, "preadv", fail)
        with pytest.raises(SwapError, match=f"offset 0 of .*swap failed: {os.strerror(errno.EIO)}"):
            f.read(0, torch.empty(10), "x")


# -- lifetime ----------------------------------------------------------------------------


def test_close_and_remove_are_idempotent_and_exit_removes(tmp_path: Path) -> None:
    f = SwapFile(tmp_path / "swap", ALIGNMENT)
    assert f.path.stat().st_size == ALIGNMENT  # reserved up front
    f.close()
    f.close()
    with pytest.raises(SwapError, match="after close"):
        f.write(0, torch.ones(1), "x")
    f.remove()
    f.remove()
    assert not f.path.exists()
    with SwapFile(tmp_path / "swap2", 3 * ALIGNMENT + 1) as g:
        assert g.path.stat().st_size == 4 * ALIGNMENT
    assert not g.path.exists()


def test_errors_form_one_family() -> None:
    assert issubclass(CorruptSwapError, SwapError)
    assert issubclass(SwapSpaceError, SwapError)
    assert issubclass(SwapError, RuntimeError)
    assert swap_file.ALIGNMENT == 4096


def test_ranks_sharing_an_offload_folder_are_checked_for_their_sum(tmp_path: Path) -> None:
    """Two ranks of one host, each needing about 6 MiB of swap, on a 10 MiB filesystem:
    each alone fits, both do not. The build refuses on every rank before any file is
    written, naming both (each once passed its own check, then both died of ENOSPC with
    99 lines of traceback); on 16 MiB both build."""
    import zero_core
    from zero_comm import Communicator, run_simulated

    def build(folder: Path) -> Any:
        def body(comm: Communicator) -> str:
            model = torch.nn.Linear(1000, 1000)
            config = zero_core.ZeroConfig(stage=3, offload_optimizer="disk",
                                          offload_dir=str(folder))  # fmt: skip
            try:
                engine = zero_core.initialize(model, torch.optim.AdamW, config, comm)
            except SwapSpaceError as exc:
                return str(exc)
            engine.close()
            return "built"

        return run_simulated(2, body)

    with tmpfs(tmp_path / "small", "size=10m") as folder:
        refused = build(folder)
        assert not list(folder.iterdir())
    for rank, message in enumerate(refused):
        assert message.startswith(f"[rank {rank}] offload folder {folder} has no room"), message
        assert "(2 ranks of this host write there" in message
    with tmpfs(tmp_path / "roomy", "size=16m") as folder:
        assert build(folder) == ["built", "built"]
