"""Where a benchmark's numbers came from: a digest of the packages' sources and the commit.

Editable installs follow the working tree, so a long benchmark can import one version and
finish on another; the tools record both digests and say if they differ.
"""

from __future__ import annotations

import hashlib
import pathlib
import platform
import subprocess
from types import ModuleType


def sources_digest(*packages: ModuleType) -> str:
    """sha256 (first 12 hex digits) of the .py files of ``packages``."""
    digest = hashlib.sha256()
    for package in packages:
        assert package.__file__ is not None
        root = pathlib.Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package.__name__}/{path.relative_to(root).as_posix()}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def git_head() -> str | None:
    """The short commit of the working tree, or None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): these machines are Intel Xeon or AMD EPYC,
    and timings compare only on one kind."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
