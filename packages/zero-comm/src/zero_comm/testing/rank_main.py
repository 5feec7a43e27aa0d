"""The program each rank of :func:`zero_comm.testing.run_on_ranks` runs.

    python -m zero_comm.testing.rank_main --file F --body QUALNAME --backend B --results DIR

It writes ``DIR/rank{R}.json`` = {"ok": bool, "error": str, "value": ..., "fingerprint":
{...}}: ok only if the body passed on *every* rank, so all ranks report the same outcome.
The rank computes with ``--threads`` intra-op threads; its fingerprint is taken after the
body, so a body that changed the count is seen.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from zero_comm.determinism import current_fingerprint
from zero_comm.launcher_env import detect_launch_env


def load_body(path: str, qualname: str) -> Any:
    # As pytest does for a test file: its directory is importable (helpers beside it).
    sys.path.insert(0, str(Path(path).parent))
    spec = importlib.util.spec_from_file_location(f"zero_rank_body_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _write(results: Path, rank: int, report: dict[str, Any]) -> None:
    tmp = results / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report, default=repr))
    tmp.rename(results / f"rank{rank}.json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file", required=True)
    parser.add_argument("--body", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--comm-timeout", type=float, default=60.0)
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--threads", type=int, required=True, help="intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rank = detect_launch_env().rank
    try:
        import zero_comm

        body = load_body(args.file, args.body)
        comm = zero_comm.init(
            args.backend, deterministic=args.deterministic, timeout=args.comm_timeout
        )
    except BaseException:
        # Not initialised: no agreement is possible; the launcher stops the others.
        _write(args.results, rank, {"ok": False, "stage": "init", "error": traceback.format_exc()})
        raise
    error = ""
    value = None
    try:
        value = body(comm, **json.loads(args.kwargs))
    except zero_comm.CommError:
        # The communicator itself failed (a peer died or timed out): it cannot carry the
        # agreement. Report and exit non-zero, so that the launcher stops the other ranks.
        _write(args.results, rank, {"ok": False, "error": traceback.format_exc()})
        sys.exit(1)
    except BaseException:
        error = traceback.format_exc()
    try:
        outcomes = comm.all_gather_object(error)
    except BaseException:
        _write(args.results, rank, {"ok": False, "error": error + traceback.format_exc()})
        raise
    failed = [r for r, e in enumerate(outcomes) if e]
    if failed:
        others = f"ranks {failed} failed" if error == "" else error
        _write(args.results, rank, {"ok": False, "error": others})
    else:
        fingerprint = current_fingerprint().to_json()
        _write(args.results, rank, {"ok": True, "error": "", "value": value,
                                    "fingerprint": fingerprint})  # fmt: skip
    comm.close()
    # Every rank knows the outcome and has recorded it; exit 0 so that the launcher does not
    # kill the others before they have written their reports.
    sys.exit(0)


if __name__ == "__main__":
    main()
