"""``zero-train``: train a GPT with ZeRO on the default corpus, or on your data.

    zero-train                              # 2 local ranks, gloo, highest stage, small GPT
    zero-train --nproc 4 --stage 1 --steps 500 --dtype bf16
    zero-train --save-every 100; zero-train --resume runs/zero-train/checkpoint --nproc 4
    mpirun -n 4 zero-train --backend mpi    # any launcher zero_comm.init understands

Run by hand (no launcher variables) it checks the options, then starts ``--nproc`` local
ranks of itself with zero-launch. Each rank trains its part of every global batch; rank 0
shows progress, and at the end prints each rank's memory next to what stage 0 would hold,
the communication per step next to the paper's 2Ψ, and a generated sample. Metrics go to
``OUT/metrics.jsonl``, the loss curve to ``OUT/loss.png`` and, with --tensorboard, the same
metrics as TensorBoard events to ``OUT/tensorboard``.

This module is the command line alone: the options are train_options.py's, the training
trainer.py's (built by run_setup.py, reported by run_report.py).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from zero_comm.launch import launch
from zero_comm.launcher_env import detect_launch_env

from .out_of_memory import EXIT_OUT_OF_MEMORY, remove_dead_ranks_swap_folders
from .run_lock import HOLDER_VARIABLE, ResultsFolderBusy, RunLock, owns_the_run
from .run_setup import prelaunch_memory_problem
from .train_engine_config import run_zero_config
from .train_options import EXIT_FAILED, EXIT_PREEMPTED, parse_options
from .trainer import Trainer

EXIT_INTERRUPTED = 130  # a shell's code for SIGINT


def main(argv: Sequence[str] | None = None) -> None:
    """:func:`train_main`; Ctrl-C (SIGINT, which zero-launch passes to every rank) ends
    each process with code 130 and one line in all, from rank 0, instead of a
    KeyboardInterrupt traceback from every rank (79 lines, once)."""
    try:
        train_main(argv)
    except KeyboardInterrupt:  # one process: no ranks of its own, no peers to wait for
        print(INTERRUPTED, file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


INTERRUPTED = (
    "zero-train: interrupted (SIGINT): stopped without saving; SIGTERM or SIGUSR1 makes "
    "every rank finish its step and save first"
)


def train_main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: sys.argv[1:]; a wrong option exits 2 with one line of
    usage). Without a launcher and with --nproc > 1, run ``--nproc`` ranks of this module
    under zero-launch and exit with its code (EXIT_FAILED, EXIT_PREEMPTED and
    EXIT_OUT_OF_MEMORY pass through as the ranks' own, each said in the ranks' own words);
    otherwise this process is one rank, and trains."""
    args = parse_options(argv)
    too_big = prelaunch_memory_problem(args)
    if too_big:
        print(f"zero-train: error: {too_big}", file=sys.stderr)
        sys.exit(2)
    lock = hold_results_folder(args.out) if owns_the_run(args.out) else None
    try:
        if detect_launch_env().launcher == "none" and args.nproc > 1:
            command = [
                sys.executable,
                "-m",
                "zero_models.train",
                *(sys.argv[1:] if argv is None else argv),
            ]
            reported = (EXIT_FAILED, EXIT_PREEMPTED, EXIT_OUT_OF_MEMORY)
            code = launch(command, args.nproc, reported_codes=reported)
            if code == EXIT_INTERRUPTED:  # every rank ended by the SIGINT passed on to it
                print(INTERRUPTED, file=sys.stderr, flush=True)
                remove_dead_ranks_swap_folders(run_zero_config(args).offload_dir)
            sys.exit(code)
        if detect_launch_env().launcher != "none":
            # A rank among others ends at SIGINT at once, as a program without a handler:
            # Python's KeyboardInterrupt waits for the C call in flight (a collective
            # whose peers are already gone), then prints a traceback on every rank.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        warnings.formatwarning = note_line
        Trainer(args).fit()
    finally:
        if lock is not None:
            lock.release()
            os.environ.pop(HOLDER_VARIABLE, None)


def hold_results_folder(out: Path) -> RunLock:
    """Take ``out``'s lock for this run and its ranks (ZERO_TRAIN_HOLDS_OUT), or stop
    with one line naming the live run that holds it."""
    try:
        lock = RunLock(out)
    except ResultsFolderBusy as exc:  # it began between the options' check and now
        print(f"zero-train: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if lock.took_over:
        print(f"zero-train: note: --out {out} was held by {lock.took_over}, which ended "
              "without letting go; this run takes it over", file=sys.stderr)  # fmt: skip
    os.environ[HOLDER_VARIABLE] = str(out.resolve())  # its ranks, if it starts them
    return lock


def note_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int,
    line: str | None = None,
) -> str:  # fmt: skip
    """A warning of our packages as one line, ``zero-train: note: ...`` (it is addressed to
    the user, who needs no source line of ours); anyone else's as Python shows it."""
    if Path(filename).parent.name in ("zero_core", "zero_comm", "zero_models"):
        return f"zero-train: note: {message}\n"
    return PYTHON_WARNING_FORMAT(message, category, filename, lineno, line)


PYTHON_WARNING_FORMAT = warnings.formatwarning


if __name__ == "__main__":
    main()
