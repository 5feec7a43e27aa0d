"""This process's own figures from /proc/self/status (Linux)."""

from __future__ import annotations


def process_status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, VmSize, VmPeak); None where
    there is no such file or field (not Linux). The one reader of that file."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
