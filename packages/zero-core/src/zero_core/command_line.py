"""The argument parser of the project's commands (zero-train, zero-estimate,
zero-consolidate): a wrong option ends in one line that names it and the fix, not in
argparse's usage block of 20 lines above the one that matters."""

from __future__ import annotations

import argparse
from typing import NoReturn


class CommandLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (PROG --help lists the
    options)`` on stderr, exit code 2, as argparse's own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")
