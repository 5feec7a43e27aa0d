"""zero_models logs under its own library logger, silent unless the application configures
logging: a NullHandler, so a library warning never reaches Python's last-resort handler
(stderr) of a program that set nothing up. zero-train prints its own lines."""

from __future__ import annotations

import logging
import subprocess
import sys


def test_the_package_logger_has_a_null_handler() -> None:
    import zero_models  # noqa: F401  (its __init__ adds the handler)

    logger = logging.getLogger("zero_models")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_a_library_warning_is_silent_in_a_program_that_configured_no_logging() -> None:
    probe = (
        "import logging, zero_models\n"
        "logging.getLogger('zero_models.gpt').warning('must not reach stderr')\n"
        "logging.getLogger('elsewhere').warning('reaches stderr')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "reaches stderr" in done.stderr  # the last-resort handler is there for others
    assert "must not reach stderr" not in done.stderr
