#!/usr/bin/env python
"""Swap-file bandwidth against the disk's own: ``dd`` with direct I/O vs ``SwapFile``.

    python -m tools.offload.swap --size-mib 256 --rounds 3
    python -m tools.offload.swap --dir /nvme/offload --size-mib 4096 --threads 8 --json swap.json

Each round builds three files and writes all three, then reads all three in the same
order, rotated from round to round (so every file is read after the same number of bytes
were written after it, and a cache under the guest, such as a virtual disk's host page
cache, favours none of them):

* ``dd``: ``dd if=SOURCE of=FILE bs=4M oflag=direct``, later ``dd if=FILE of=/dev/null
  bs=4M iflag=direct``, timed by dd itself. SOURCE is a file of random bytes in /dev/shm (a
  disk or its host may treat zeros specially; ``--dd-source zero`` uses /dev/zero instead).
* ``ours``: a fresh ``SwapFile`` of ``--size-mib`` (its fallocate is not timed), written and
  read in ``--block-mib`` blocks by a pool of ``--threads`` threads, each block taken from
  and returned to a fixed set of ``--buffers`` aligned buffers, with checksums.
* ``raw``: the same pool and buffers with bare ``os.pwritev``/``os.preadv`` on an O_DIRECT
  file: no checksums, no SwapFile; the gap between raw and ours is the module's cost.
* ``crc32``: then ``zlib.crc32`` alone over ``--size-mib`` on the same pool, so the share
  of the checksum in ours is visible.

Each O_DIRECT request needs one segment per physically contiguous run of its buffer, and
a virtio disk takes at most 254 per request: our buffers come from ``aligned_empty``
(transparent huge pages from 2 MiB up), dd's are whatever malloc gives in 4 KiB pages.
dd's figures swing 2-5x between runs on the development VM, most likely with how much of
its buffer happens to be contiguous; ``--page-buffers`` gives ours 4 KiB pages too.

Prints medians and min-max in MB/s (10^6 bytes/s, as dd prints them) and the ratios ours/dd.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from zero_core.offload.swap_file import ALIGNMENT, SwapFile, aligned_empty, check_offload_dir

MIB = 2**20
DD_BLOCK = 4 * MIB


def memview(t: torch.Tensor) -> memoryview:
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def dd_seconds(args: list[str]) -> float:
    """Run dd and return the seconds it reports for the copy."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"dd {' '.join(args)} failed: {done.stderr.strip()}")
    match = re.search(r"copied, ([0-9.eE+-]+) s", done.stderr)
    if match is None:
        sys.exit(f"cannot parse dd's output: {done.stderr.strip()}")
    return float(match.group(1))


def page_buffer(nbytes: int) -> torch.Tensor:
    """An ALIGNMENT-aligned buffer of ordinary 4 KiB pages (what torch.empty gives)."""
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    shift = -raw.data_ptr() % ALIGNMENT
    return raw[shift : shift + nbytes]


class Pool:
    """A thread pool and a fixed set of aligned buffers that blocks borrow and return."""

    def __init__(self, threads: int, buffers: int, block: int, pages: bool = False) -> None:
        self.executor = ThreadPoolExecutor(threads)
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        gen = torch.Generator().manual_seed(0)
        for _ in range(buffers):
            buf = page_buffer(block) if pages else aligned_empty(block, torch.uint8)
            buf.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8, generator=gen))
            self.free.put(buf)

    def run(self, nblocks: int, fn: Callable[[int, torch.Tensor], object]) -> float:
        """Seconds to apply ``fn(block_index, buffer)`` to every block."""

        def task(i: int) -> None:
            buf = self.free.get()
            try:
                fn(i, buf)
            finally:
                self.free.put(buf)

        start = time.perf_counter()
        list(self.executor.map(task, range(nblocks)))
        return time.perf_counter() - start


class Contender:
    """One way of moving ``nbytes`` to a file and back; ``write`` then ``read`` return
    bytes per second, ``close`` removes the file."""

    name = ""

    def write(self) -> float:
        raise NotImplementedError

    def read(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class DD(Contender):
    """``dd bs=4M`` with O_DIRECT: one 4 MiB request at a time, timed by dd."""

    name = "dd"

    def __init__(self, folder: Path, source: str, nbytes: int) -> None:
        self.path, self.source, self.nbytes = folder / "dd.bin", source, nbytes

    def write(self) -> float:
        count = self.nbytes // DD_BLOCK
        args = [f"if={self.source}", f"of={self.path}", "bs=4M", f"count={count}"]
        return self.nbytes / dd_seconds([*args, "oflag=direct"])

    def read(self) -> float:
        args = [f"if={self.path}", "of=/dev/null", "bs=4M", "iflag=direct"]
        return self.nbytes / dd_seconds(args)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class Ours(Contender):
    """A fresh SwapFile (its fallocate untimed), blocks moved by the pool, with checksums."""

    name = "ours"

    def __init__(self, folder: Path, pool: Pool, nbytes: int, block: int) -> None:
        self.file = SwapFile(folder / "swap.bin", nbytes)
        if not self.file.direct:
            print(f"note: {folder} refuses O_DIRECT; SwapFile uses buffered I/O")
        self.pool, self.nbytes, self.block = pool, nbytes, block

    def write(self) -> float:
        f, block = self.file, self.block
        return self.nbytes / self.pool.run(
            self.nbytes // block, lambda i, buf: f.write(i * block, buf, f"b{i}")
        )

    def read(self) -> float:
        f, block = self.file, self.block
        return self.nbytes / self.pool.run(
            self.nbytes // block, lambda i, buf: f.read(i * block, buf, f"b{i}")
        )

    def close(self) -> None:
        self.file.remove()


class Raw(Contender):
    """The same pool and buffers with bare pwritev/preadv on an O_DIRECT file: no
    checksums, no SwapFile."""

    name = "raw"

    def __init__(self, folder: Path, pool: Pool, nbytes: int, block: int) -> None:
        self.path = folder / "raw.bin"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        self.fd = os.open(self.path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        self.pool, self.nbytes, self.block = pool, nbytes, block

    def _run(self, call: Callable[[int, list[memoryview], int], int]) -> float:
        fd, block = self.fd, self.block

        def move(i: int, buf: torch.Tensor) -> None:
            view, done = memview(buf), 0
            while done < block:
                done += call(fd, [view[done:]], i * block + done)

        return self.nbytes / self.pool.run(self.nbytes // block, move)

    def write(self) -> float:
        return self._run(os.pwritev)

    def read(self) -> float:
        return self._run(os.preadv)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def bench_round(
    r: int, folder: Path, source: str, pool: Pool, nbytes: int, block: int
) -> dict[str, float]:
    """All writes, then all reads in the same order, rotated each round: every file is read
    after the same number of bytes were written after it, so a cache below the guest (a
    virtual disk's host page cache) favours none of them."""
    contenders: list[Contender] = [
        DD(folder, source, nbytes),
        Ours(folder, pool, nbytes, block),
        Raw(folder, pool, nbytes, block),
    ]
    shift = r % len(contenders)
    contenders = contenders[shift:] + contenders[:shift]
    fig: dict[str, float] = {}
    try:
        for c in contenders:
            fig[f"{c.name}_write"] = c.write()
        for c in contenders:
            fig[f"{c.name}_read"] = c.read()
    finally:
        for c in contenders:
            c.close()
    fig["crc32"] = bench_crc(pool, nbytes, block)
    return fig


def bench_crc(pool: Pool, nbytes: int, block: int) -> float:
    return nbytes / pool.run(nbytes // block, lambda i, buf: zlib.crc32(memview(buf)))


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dir", type=Path, help="folder to test (default: a temp dir in /tmp)")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--block-mib", type=int, default=16)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dd-source", choices=["random", "zero"], default="random")
    parser.add_argument(
        "--page-buffers",
        action="store_true",
        help="buffers of 4 KiB pages instead of aligned_empty's huge-page-backed ones",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--markdown", type=Path, help="write a report (docs/benchmarks/swap.md)")
    args = parser.parse_args()
    nbytes, block = args.size_mib * MIB, args.block_mib * MIB
    if args.size_mib % args.block_mib or args.size_mib % 4 or min(args.threads, args.buffers) < 1:
        parser.error("--size-mib must be a multiple of --block-mib and of 4; threads, buffers >= 1")
    torch.set_num_threads(1)
    scratch = None if args.dir else tempfile.mkdtemp(prefix="bench-swap-", dir="/tmp")
    folder = check_offload_dir(args.dir or str(scratch), 3 * nbytes)
    source = "/dev/zero"
    if args.dd_source == "random":
        shm = Path(tempfile.mkstemp(prefix="bench-swap-src-", dir="/dev/shm")[1])
        with open(shm, "wb") as out:
            for _ in range(nbytes // (64 * MIB)):
                out.write(os.urandom(64 * MIB))
            out.write(os.urandom(nbytes % (64 * MIB)))
        source = str(shm)
    pool = Pool(args.threads, args.buffers, block, args.page_buffers)
    names = ["dd_write", "dd_read", "ours_write", "ours_read", "raw_write", "raw_read", "crc32"]
    rounds: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            fig = bench_round(r, folder, source, pool, nbytes, block)
            rounds.append(fig)
            print(f"round {r}: " + "  ".join(f"{k} {fig[k] / 1e6:.0f}" for k in names) + " MB/s")
    finally:
        pool.executor.shutdown()
        if source != "/dev/zero":
            Path(source).unlink(missing_ok=True)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = {k: spread([fig[k] for fig in rounds]) for k in names}
    ratios = {
        f"ours/dd_{op}": summary[f"ours_{op}"]["median"] / summary[f"dd_{op}"]["median"]
        for op in ("write", "read")
    }
    ratios.update(
        {
            f"raw/dd_{op}": summary[f"raw_{op}"]["median"] / summary[f"dd_{op}"]["median"]
            for op in ("write", "read")
        }
    )
    print(
        f"\n{folder}: {args.size_mib} MiB, blocks of {args.block_mib} MiB, {args.threads} "
        f"threads, {args.buffers} {'4 KiB-page' if args.page_buffers else 'huge-page'} "
        f"buffers, {args.rounds} rounds, dd from {source}"
    )
    print(f"{'':12} {'median':>8} {'min':>8} {'max':>8}  MB/s")
    for k in names:
        s = summary[k]
        print(f"{k:12} {s['median'] / 1e6:8.0f} {s['min'] / 1e6:8.0f} {s['max'] / 1e6:8.0f}")
    for k, v in ratios.items():
        print(f"{k:12} {v:8.2f}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "dir", "markdown")}
        config["dir"] = str(folder)
        report = {"config": config, "rounds": rounds, "summary": summary, "ratios": ratios}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(args, summary, ratios, source))


def markdown(
    args: argparse.Namespace, summary: dict[str, dict[str, float]], ratios: dict[str, float],
    source: str,
) -> str:  # fmt: skip
    """The figures as docs/benchmarks/swap.md."""
    rows = []
    for op in ("write", "read"):
        cells = [
            f"{summary[f'{who}_{op}']['median'] / 1e6:.0f} "
            f"[{summary[f'{who}_{op}']['min'] / 1e6:.0f}-{summary[f'{who}_{op}']['max'] / 1e6:.0f}]"
            for who in ("dd", "ours", "raw")
        ]
        rows.append(f"| {op} | {' | '.join(cells)} | {ratios[f'ours/dd_{op}']:.2f} |")
    crc = summary["crc32"]
    return "\n".join(
        [
            "# Swap I/O: the disk pipeline against the disk's own bandwidth",
            "",
            f"Generated by `python -m tools.offload.swap {' '.join(sys.argv[1:])}`.",
            "",
            f"{args.size_mib} MiB per contender per round, {args.rounds} rounds, the order of the "
            "contenders rotated each round, every file read after all three were written. "
            f"`dd` with `oflag=direct` / `iflag=direct`, bs=4M, from {source}; ours: "
            "zero_core.offload.swap_file.SwapFile (O_DIRECT, crc32 per block) "
            f"on {args.threads} threads, "
            f"blocks of {args.block_mib} MiB, {args.buffers} buffers; raw: the same thread pool "
            "with bare pwritev/preadv, no checksums. MB/s, median [min-max].",
            "",
            "| | dd | ours | raw | ours / dd |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"crc32 alone on the pool: {crc['median'] / 1e6:.0f} "
            f"[{crc['min'] / 1e6:.0f}-{crc['max'] / 1e6:.0f}] MB/s. The goal is ours >= 0.70 of "
            "dd for read and for write. dd is one stream at queue depth 1; raw, the same threads "
            "without checksums, is what this disk gives in parallel: ours / raw = "
            f"{summary['ours_write']['median'] / summary['raw_write']['median']:.2f} (write), "
            f"{summary['ours_read']['median'] / summary['raw_read']['median']:.2f} (read), the "
            "rest being the crc32 of every block.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
