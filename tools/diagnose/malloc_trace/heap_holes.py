"""Which live blocks keep glibc's heap from reusing its holes, from a malloc_trace.c log.

Replays the log of one process. Each time a request of ``--min-request`` bytes or more
extends the main heap's top (sbrk), it lists the holes below that are about the request's
size (freed blocks of the same size the request cannot reuse) and counts the live blocks
that bound them, by (size, call site, phase allocated in). Small blocks that outlive the
step and sit at the edges of freed activations are what to look for
(docs/stage3-memory.md, "The heap's holes: torch's flight recorder").

    gcc -O2 -shared -fPIC -o /tmp/malloc_trace.so tools/diagnose/malloc_trace/malloc_trace.c \\
        -ldl -lpthread
    zero-launch -n 4 sh -c '[ "$RANK" = 0 ] && export LD_PRELOAD=/tmp/malloc_trace.so \\
        MALLOC_TRACE_ALL=1 MALLOC_TRACE_OUT=/tmp/trace; exec python my_script.py'
    python -m tools.diagnose.malloc_trace.heap_holes /tmp/trace.<pid>

The main heap is told apart from mmapped blocks and other arenas by address (below
``--heap-below``, 0x7000_0000_0000 on x86-64 Linux).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
from collections.abc import Iterator


def frames(lines: list[str]) -> list[str]:
    """Function names of a backtrace_symbols_fd backtrace (those it could name)."""
    names = []
    for line in lines:
        if "(" in line:
            name = line.split("(", 1)[1].split("+", 1)[0]
            if name and not name.startswith(")"):
                names.append(name)
    return names


def events(path: str) -> Iterator[tuple[str, list[str]]]:
    """("B", [hash, *frames]) | ("M", [text]) | ("+", [ptr, size, hash, tid]) | ("-", [ptr])"""
    with open(path, errors="replace") as log:
        for line in log:
            kind = line[:1]
            if kind == "B":
                _, key, depth = line.split()
                yield "B", [key, *frames([next(log) for _ in range(int(depth))])]
            elif kind == "M":
                yield "M", [line[2:].rstrip("\n")]
            elif kind in "+-":
                yield kind, line.split()[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--min-request", type=int, default=64 << 10)
    p.add_argument("--heap-below", type=lambda v: int(v, 0), default=0x7000_0000_0000)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    sites: dict[str, list[str]] = {}
    live: dict[int, tuple[int, str, str]] = {}  # address: (size, call site, phase)
    starts: list[int] = []  # live main-heap addresses, sorted
    heap_top, phase, extensions = 0, "start", 0
    bounds: collections.Counter[tuple[int, str, str]] = collections.Counter()
    for kind, fields in events(args.log):
        if kind == "B":
            sites[fields[0]] = fields[1:]
        elif kind == "M":
            phase = fields[0]
        elif kind == "+":
            address, size = int(fields[0], 16), int(fields[1])
            if not address or address >= args.heap_below:
                continue
            if address not in live:  # else its free was not logged: the new block replaces it
                bisect.insort(starts, address)
            live[address] = (size, fields[2], phase)
            end = address + size
            if end > heap_top:
                if heap_top and size >= args.min_request and phase != "start":
                    extensions += 1
                    for below, above in itertools.pairwise(starts):
                        hole = above - (below + live[below][0])
                        if size - 4096 <= hole < size + 256:
                            for edge in (below, above):
                                if live[edge][0] < args.min_request:
                                    bounds[live[edge]] += 1
                heap_top = end
        elif kind == "-":
            address = int(fields[0], 16)
            if live.pop(address, None) is not None:
                del starts[bisect.bisect_left(starts, address)]
    print(f"{extensions} requests of >= {args.min_request} bytes extended the heap's top")
    print("blocks bounding holes of the request's size: count, size, phase, call site")
    for (size, site, born), count in bounds.most_common(args.top):
        where = " < ".join(sites.get(site, [])[:5]) or "(no backtrace)"
        print(f"{count:7d} {size:6d} B  after mark {born!r:12} {where[:220]}")


if __name__ == "__main__":
    main()
