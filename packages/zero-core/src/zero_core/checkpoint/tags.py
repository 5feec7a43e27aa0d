"""A folder of tagged checkpoints, as DeepSpeed lays them out: ``DIR/<tag>/`` and ``DIR/latest``.

    DIR/
      hparams.json, tb/, ...     the user's own files: never read, moved or deleted
      latest                     the last tag saved, one line, replaced atomically
      global_step100/            one checkpoint per tag (writer.py's layout)
      global_step200/

``engine.save(DIR)`` writes ``DIR/global_step<N>/`` (or ``DIR/<tag>/``) atomically, then
points ``latest`` at it; ``engine.load(DIR)`` follows ``latest`` (reader.complete_checkpoint).
Every rank first meets the others at "save()" (zero_comm.arrival): a rank that exited
without calling save is named in seconds, one alive elsewhere (still training, in another
collective) after ``arrival_timeout`` seconds (by default the communicator's timeout,
with a warning naming it after a minute); a slow rank that comes within it saves as
usual. A folder saved before tags existed (``DIR/index.json``) still loads. With
``keep_last=K`` the save removes the older checkpoints of DIR beyond the newest K: only
folders that hold a zero-checkpoint index, which this library wrote; nothing else of DIR
is touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from zero_comm import Communicator

from .format import FORMAT, INDEX, LATEST, CheckpointError
from .sharded_state import ShardedState
from .writer import fsync_dir, save

DEFAULT_TAG = "global_step{steps}"


def check_tag(tag: str) -> None:
    """A tag names one folder inside DIR: no separators, not ``latest``, no leading dot."""
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} must name one folder inside the checkpoint folder (no "
            f"'/', no leading '.', not {LATEST!r}); for example 'global_step100'"
        )


def save_tagged(
    state: ShardedState,
    comm: Communicator,
    folder: Path,
    tag: str,
    extra: dict[str, object] | None = None,
    keep_last: int | None = None,
    arrival_timeout: float | None = None,
) -> Path:
    """Collective: write ``state`` to ``folder/tag`` (writer.save), then point
    ``folder/latest`` at it and, with ``keep_last``, remove older checkpoints beyond the
    newest ``keep_last``. Every rank must pass the same folder and tag: otherwise every
    rank raises one CheckpointError naming each rank's. A rank that does not call it is
    named (see the module doc) after at most ``arrival_timeout`` seconds. Returns
    ``folder/tag``."""
    check_tag(tag)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: keep at least the checkpoint being saved (1)")
    if arrival_timeout is not None and not arrival_timeout > 0:
        raise ValueError(f"arrival_timeout={arrival_timeout}: give seconds > 0")
    # Before the save's first collective: a rank that never comes is named, not waited for.
    comm.meet("save()", within=arrival_timeout, longer="save(..., arrival_timeout=SECONDS)")
    target = folder / tag
    mine = (str(folder.resolve()), tag)
    verdict = _target_problem(target) if comm.rank == 0 else ""
    everyone = comm.all_gather_object((mine, verdict))
    targets = [t for t, _ in everyone]
    if any(t != targets[0] for t in targets):
        named = "; ".join(f"rank {r}: {p}/{t}" for r, (p, t) in enumerate(targets))
        raise CheckpointError(
            f"[rank {comm.rank}] save() was given different checkpoint folders or tags on "
            f"different ranks ({named}): every rank must save to the same folder and tag"
        )
    if everyone[0][1]:
        raise CheckpointError(f"[rank {comm.rank}] {everyone[0][1]}")
    save(state, comm, target, extra)
    if comm.rank == 0:
        write_latest(folder, tag)
        if keep_last is not None:
            remove_older(folder, keep_last, tag)
    comm.barrier()
    return target


def _target_problem(target: Path) -> str:
    """Why ``target`` may not be (re)written, or "": a folder that is not a checkpoint of
    ours (the user's own) is never replaced."""
    if target.exists() and not target.is_dir():
        return f"{target} is a file, not a checkpoint: save under another tag"
    if target.is_dir() and any(target.iterdir()) and _checkpoint_steps(target) is None:
        return (
            f"{target} exists and is not a checkpoint (it has no {INDEX} of {FORMAT}): it "
            "is left alone; save under another tag, or move it away"
        )
    return ""


def write_latest(folder: Path, tag: str) -> None:
    """Point ``folder/latest`` at ``tag``: a new file renamed over the old, so a reader
    sees the old tag or the new one, never a partial name."""
    partial = folder / f".{LATEST}.partial"
    with partial.open("w") as out:
        out.write(tag + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, folder / LATEST)
    fsync_dir(folder)


def remove_older(folder: Path, keep_last: int, current: str) -> list[Path]:
    """Remove the checkpoints of ``folder`` beyond the newest ``keep_last`` (by saved step,
    then modification time), ``current`` always kept; only folders holding a
    zero-checkpoint index are candidates. Returns what was removed."""
    found = []
    for child in folder.iterdir():
        transient = child.name.endswith((".saving", ".old"))  # a save's own, in flight
        if child.is_dir() and child.name != current and not transient:
            steps = _checkpoint_steps(child)
            if steps is not None:
                found.append((steps, child.stat().st_mtime, child))
    found.sort(reverse=True)
    removed = [path for _, _, path in found[max(0, keep_last - 1) :]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _checkpoint_steps(path: Path) -> int | None:
    """The global step a checkpoint folder was saved at, or None if ``path`` does not hold
    one written by this library."""
    try:
        index = json.loads((path / INDEX).read_text())
        if index.get("format") != FORMAT:
            return None
        return int(index.get("engine", {}).get("global_steps", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
