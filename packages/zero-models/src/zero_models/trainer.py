"""One rank's zero-train run: the training loop, its checkpoints, and preemption.

    trainer = Trainer(args)   # on every rank of a launched job; args from parse_options
    trainer.fit()             # returns after the report, or exits the process (see fit)

Every rank runs the same steps and the same collectives in the same order; rank 0 (the
lead) alone prints, writes ``OUT/metrics.jsonl`` (and with --tensorboard the same values as
TensorBoard events) and clears an --overwrite'd folder. A rank that runs out of memory, in
the build or in a step, prints one line naming where and what would fit, and exits with
out_of_memory.EXIT_OUT_OF_MEMORY.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from fractions import Fraction
from pathlib import Path
from types import FrameType
from typing import NoReturn, TextIO

import torch
from torch.nn import functional as F
from tqdm import tqdm

import zero_comm
import zero_core
from zero_comm.launcher_env import detect_launch_env
from zero_core.memory.proc_status import process_status_kib

from .hetero_profile import prediction_check, warn_overruns
from .out_of_memory import stop_in_one_line
from .phase_memory import phase_record, phase_table
from .run_metrics import corpus_digest, open_metrics
from .run_report import report
from .run_setup import build_run
from .run_tensorboard import TensorBoardLog
from .tp_layers import vocab_parallel_cross_entropy
from .train_options import (
    CHECKPOINT,
    EXIT_FAILED,
    EXIT_PREEMPTED,
    RESULTS,
    earlier_results,
    threads_per_rank,
)
from .train_schedule import learning_rate, own_schedule


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 where there is none)."""
    return (process_status_kib("VmRSS") or 0) / 1024


def current_lr(engine: zero_core.ZeroEngine) -> float:
    """The learning rate the engine's optimizer steps with now (its first group's)."""
    return float(engine.optimizer.param_groups[0]["lr"])


class PreemptionFlag:
    """Set by the first of ``signals`` this rank receives (SLURM's SIGTERM at preemption or
    time limit, a --signal=USR1 warning); the training loop reads it at the end of a step.

    The handler only records the signal: the step in flight finishes, the ranks agree at
    the step's loss all-reduce (any rank's flag stops all), save, and exit. The same
    signal a second time ends the process at once, as if it had no handler: a step that
    never ends (a probe's --context 1000000 ran 500 s in its first) must not make the
    process deaf to ``kill``."""

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.received: signal.Signals | None = None
        for signum in signals:
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            return
        name = signal.Signals(signum).name
        print(f"zero-train: {name} again: stopping now, without saving", file=sys.stderr)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def clear_earlier_results(out: Path) -> None:
    """--overwrite: remove what another run left in ``out`` (its checkpoint too, so that a
    later --resume auto cannot pick up that run's state)."""
    for name in RESULTS:
        for path in (out / name, out / f"{name}.old", out / f"{name}.saving"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


# resident MiB, step seconds, intra-node bytes, inter-node bytes, seconds per slot
RANK_STATS = 5


class Trainer:
    """The state of one rank's run: its parts (``run_setup.Run``), the steps to train
    (``first_step``, after --resume, up to ``end_step``, --stop-after or --steps), the
    preemption flag, and on the lead rank the metrics file (and --tensorboard's writer), the
    progress display and the (step, loss) history.

    Construction is collective and in this order: signal handlers installed (a signal from
    now on stops the run after a step), torch's thread count set, the run built, --resume
    loaded; then the lead announces the run and opens OUT/metrics.jsonl (appending when
    resumed) and, with --tensorboard, an event file (a resumed run adds its own to the
    folder). The data a step reads and its learning rate are functions of the step and the
    seed alone, so a run resumed at a step continues bit for bit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.memory_mib: float | None = None  # this step's, where read before its update
        self.slot_losses: list[float] = []  # this step's mean loss per micro-batch slot
        self.preemption = PreemptionFlag(args.preempt_signals)
        threads, threads_from = threads_per_rank(args.threads, detect_launch_env().local_world_size)
        torch.set_num_threads(threads)
        self.run = build_run(args, signalled=lambda: self.preemption.received is not None)
        self.engine = self.run.engine
        self.lead = self.run.world.rank == 0
        self.end_step: int = args.steps if args.stop_after is None else args.stop_after
        self.tokens_per_step = args.batch_size * args.grad_accum * self.run.config.context
        self.history: list[tuple[int, float]] = []
        self.step_seconds: list[float] = []  # lead: each step's slowest rank's seconds
        self.slot_seconds = 0.0  # this rank's median slot in the last step (optimizer_step)
        self.metrics: TextIO | None = None
        self.tensorboard: TensorBoardLog | None = None
        self.progress: tqdm[None] | None = None
        self.started = 0.0  # perf_counter() when fit() began
        self.phase = "the start-up"  # where this rank is, for the line it may end with
        with self.stops_in_one_line():
            self.first_step = self.resume()
            self.phase = "the start-up"
            if self.lead:
                plural = "s" if threads > 1 else ""
                self.announce(f"{threads} thread{plural} per rank ({threads_from})")
                self.metrics = self.open_metrics()
                if args.tensorboard is not None:
                    self.tensorboard = TensorBoardLog(args.tensorboard, self.first_step)

    def resume(self) -> int:
        """Collective: load --resume into the engine (none: a fresh start); the step to
        start from, which the checkpoint's extra data records (``save``)."""
        if self.args.resume is None:
            return 0
        self.phase = f"the load of {self.args.resume}"
        try:
            return int(self.engine.load(self.args.resume).get("step", 0))
        except zero_core.CheckpointError as exc:  # another model, a value's checksum, ...
            # A value's checksum fails on the ranks that read it: each says what it met.
            rank = self.run.world.rank
            print(f"zero-train: error: [rank {rank}] --resume: {exc}", file=sys.stderr, flush=True)
            self.engine.close()
            sys.exit(EXIT_FAILED)

    def stops_in_one_line(self) -> AbstractContextManager[None]:
        """A block in which running out of memory, or a peer's end met in a collective,
        ends this rank with one line naming ``self.phase`` (out_of_memory), after
        removing its swap files."""
        run = self.run
        return stop_in_one_line(
            run.world.rank, lambda: self.phase, run.footprint, before=self.engine.close,
            signalled=lambda: self.preemption.received is not None, world=run.world,
        )  # fmt: skip

    def announce(self, threads: str) -> None:
        """Lead: clear an --overwrite'd folder, then say what is about to train."""
        args, config, dp = self.args, self.run.config, self.run.mesh.dp
        found = earlier_results(args.out)
        if (args.overwrite or args.fresh_after_auto) and args.resume is None and found:
            clear_earlier_results(args.out)
            why = "--overwrite" if args.overwrite else (
                f"--resume auto: no checkpoint in {args.out / CHECKPOINT}, so from step 1"
            )  # fmt: skip
            print(f"zero-train: {why}: removed the earlier run's {', '.join(found)} "
                  f"from {args.out}", flush=True)  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        if args.resume is not None:
            print(f"zero-train: resumed from {args.resume} at step {self.first_step}", flush=True)
        print(
            f"zero-train: GPT {config.layers}x{config.width} ({config.num_params / 1e6:.2f}M "
            f"parameters), stage {args.stage}, {self.run.world.world_size} ranks ({args.tp} "
            f"tensor-parallel x {dp.world_size} data-parallel) on {dp.backend}, {args.dtype}, "
            f"{self.run.tokens.numel():,} tokens of data, {threads}",
            flush=True,
        )
        counts = args.micro_batches_per_rank
        if counts is not None:
            weights = "" if args.shard_weights is None else (
                ", shard weights " + ",".join(f"{w:g}" for w in args.shard_weights)
            )  # fmt: skip
            print(f"zero-train: micro-batches per rank {','.join(map(str, counts))} "
                  f"({sum(counts)} virtual ranks of {args.batch_size // sum(counts)} "
                  f"sequences){weights}", flush=True)  # fmt: skip

    def open_metrics(self) -> TextIO:
        """Lead: OUT/metrics.jsonl opened with this segment's run record (what the bits
        depend on) as its first line; appended to when the run was resumed."""
        run_record = {"fingerprint": self.engine.fingerprint().to_json(),
                      "corpus": corpus_digest(self.run.tokens), "first_step": self.first_step,
                      "argv": sys.argv[1:], **self.hetero_record()}  # fmt: skip
        path = self.args.out / "metrics.jsonl"
        return open_metrics(path, run_record, append=self.first_step > 0)

    def hetero_record(self) -> dict[str, object]:
        """The run record's mixed-hardware part (empty for a homogeneous run): the counts
        and weights trained with, and what 'auto' measured and predicted."""
        args, auto = self.args, self.run.auto
        record: dict[str, object] = {}
        if args.micro_batches_per_rank is not None:
            record["micro_batches_per_rank"] = list(args.micro_batches_per_rank)
        if args.shard_weights is not None:
            record["shard_weights"] = list(args.shard_weights)
        if auto is not None:
            record["auto"] = {
                "predicted_step_s": auto.predicted_step_seconds,
                "even_split_step_s": auto.even_step_seconds,
                "profiles": [p._asdict() for p in auto.profiles],
            }
        return record

    def fit(self) -> None:
        """Train steps ``first_step`` to ``end_step - 1`` (with --save-every, saving
        OUT/checkpoint every that many steps and after the end step); then report and
        close the communicators.

        A signal (PreemptionFlag) on any rank stops every rank after the same step: it is
        saved and the process exits with EXIT_PREEMPTED. A failed save exits with
        EXIT_FAILED (``save``)."""
        self.started = time.perf_counter()
        if self.first_step >= self.end_step:
            self.nothing_to_train()
            return
        # A progress bar on a terminal; plain lines (every 5% of the run) in a log file.
        if self.lead and sys.stdout.isatty():
            self.progress = tqdm(total=self.end_step, initial=self.first_step,
                                 desc="zero-train", unit="step", file=sys.stdout)  # fmt: skip
        step, stopping = self.first_step, False
        with self.stops_in_one_line():
            for step in range(self.first_step, self.end_step):
                stopping = self.train_one(step)
                if stopping:
                    break
        self.close_logs()
        if stopping:
            self.exit_preempted(step)
        self.finish()

    def nothing_to_train(self) -> None:
        """The resumed checkpoint is at or past the end step: say so, close, no report."""
        self.close_logs()
        if self.lead:
            print(
                f"zero-train: {self.args.resume} is at step {self.first_step}, the end of this "
                f"run ({self.end_step} steps): nothing to train; give a larger --steps to go on",
                flush=True,
            )
        self.run.close()

    def train_one(self, step: int) -> bool:
        """Step ``step`` on this rank; then, with every rank, the mean loss and whether any
        rank was signalled, and each rank's memory and time; save when due or stopping; the
        lead logs the step. True: every rank stops after this step."""
        step_start = time.perf_counter()
        if step == self.end_step - 1:
            self.engine.comm.stats.reset()  # the last step's traffic is what gets reported
        own = own_schedule(self.args)
        step_lr = learning_rate(step, self.args) if own else current_lr(self.engine)
        links_before = self.engine.comm.family_link_bytes()
        own_loss, grad_norm = self.optimizer_step(step)
        links_after = self.engine.comm.family_link_bytes()
        links = [b - a for a, b in zip(links_before, links_after, strict=True)]
        self.phase = f"the end of step {step + 1}"
        loss, stopping = self.agree(own_loss)
        per_rank = self.gather_rank_stats(time.perf_counter() - step_start, links)
        if stopping or self.save_due(step):
            self.phase = f"the save after step {step + 1}"
            self.save(step)
            self.phase = f"the end of step {step + 1}"
        if self.metrics is not None:
            self.log(step, loss, step_lr, grad_norm, per_rank, stopping)
        return stopping

    def optimizer_step(self, step: int) -> tuple[float, float | None]:
        """One optimizer step (--grad-accum micro-batches of step ``step``'s batch, at the
        step's learning rate when zero-train owns the schedule): this rank's mean loss, and
        the global gradient norm before clipping, where known (None without clipping, which
        alone computes it, and when a non-finite gradient skipped the update)."""
        args, engine, tracker = self.args, self.engine, self.run.tracker
        if own_schedule(args):
            for group in engine.optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
        applied = False
        # Each slot's mean loss over the micro-steps (one slot without
        # --micro-batches-per-rank): what its virtual rank would report at V ranks.
        slots = self.run.sampler.slots
        self.slot_losses = [0.0] * slots
        slot_seconds: list[float] = []
        for micro in range(args.grad_accum):
            for slot in range(slots):
                started = time.perf_counter()
                with self.run.padding:  # --emulate-micro-batch-seconds; else nothing
                    loss = self.forward_backward(step, micro, slot)
                if slot < slots - 1 or slots == 1:  # the last of several waits for the rows
                    slot_seconds.append(time.perf_counter() - started)
                self.slot_losses[slot] += loss / args.grad_accum
            self.phase = f"the optimizer step of step {step + 1}"
            if micro == args.grad_accum - 1:
                # With the delayed update, memory_report waits for the update in flight:
                # read just before the step (which waits for it anyway), not after it,
                # where the wait would take the update's overlap with the next step away.
                delayed = engine.delayed_update is not None and self.metrics is not None
                self.memory_mib = engine.memory_report().total / 2**20 if delayed else None
            with tracker.phase("step"):
                applied = engine.step()  # True at the last micro-batch, unless skipped
        self.slot_seconds = statistics.median(slot_seconds)
        return self.slot_losses[0], engine.last_grad_norm if applied else None

    def forward_backward(self, step: int, micro: int, slot: int) -> float:
        """Forward and backward of slot ``slot`` of micro-step ``micro`` (the data of its
        virtual rank, see data.py); its loss."""
        args, engine, tracker = self.args, self.engine, self.run.tracker
        batch = self.run.sampler.batch(step, micro, slot)
        inputs, targets = (t.to(self.run.world.device) for t in batch)
        self.phase = f"the forward of step {step + 1}"
        with tracker.phase("forward"):
            logits = engine(inputs)
            if args.tp > 1:
                loss = vocab_parallel_cross_entropy(logits, targets, self.run.mesh.tp)
            else:
                loss = F.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)
                )
            del logits  # the loss's graph keeps what backward needs
        self.phase = f"the backward of step {step + 1}"
        with tracker.phase("backward"):
            engine.backward(loss)
        return float(loss.item())

    def agree(self, loss: float) -> tuple[float, bool]:
        """Collective: (the mean of every rank's ``loss``, whether any rank's preemption
        flag is set); every rank gets the same pair.

        With --micro-batches-per-rank the mean is over the V virtual ranks' slot losses
        (``self.slot_losses``), summed in virtual-rank order and divided by V in float32:
        the bits the homogeneous run at V ranks gets from its AVG all-reduce."""
        comm = self.run.metrics_comm
        signalled = float(self.preemption.received is not None)
        counts = self.args.micro_batches_per_rank
        if counts is None:
            mean = torch.tensor([loss, signalled], device=comm.device)
            comm.all_reduce(mean, zero_comm.ReduceOp.AVG)
            return float(mean[0].item()), bool(mean[1] > 0)
        rows = torch.tensor(
            [
                [slot_loss, signalled if s == 0 else 0.0]
                for s, slot_loss in enumerate(self.slot_losses)
            ],
            device=comm.device,
        )  # fmt: skip  (c_rank, 2), float32 as the homogeneous run's tensor
        mean = rows.new_empty(2)
        comm.all_reduce_rows(mean, rows, counts, zero_comm.ReduceOp.SUM)
        mean.div_(sum(counts))
        return float(mean[0].item()), bool(mean[1] > 0)

    def gather_rank_stats(self, step_s: float, links: list[Fraction]) -> torch.Tensor:
        """Collective: every rank's (resident MiB, ``step_s``, intra-node and inter-node
        bytes its engine's communicators sent in the step, the median seconds of its
        micro-batch slots: those before the last of each micro-step when it runs several,
        since the last waits for the other ranks), rank by rank as one flat
        float64 tensor of RANK_STATS columns, for the metrics (tools/diagnose/soak.py reads
        them)."""
        comm = self.run.metrics_comm
        stats = [resident_mib(), step_s, *map(float, links), self.slot_seconds]
        mine = torch.tensor(stats, dtype=torch.float64, device=comm.device)
        per_rank = mine.new_empty(RANK_STATS * comm.world_size)
        comm.all_gather(per_rank, mine)
        return per_rank.cpu()

    def save_due(self, step: int) -> bool:
        """Whether a save is asked for after ``step``: every --save-every steps, and after
        the run's end step unless --no-final-save."""
        every = self.args.save_every
        if step + 1 == self.end_step and self.args.final_save:
            return True
        return bool(every) and (step + 1) % every == 0

    def save(self, step: int) -> None:
        """Collective: save OUT/checkpoint after ``step``; a failed save (every rank has the
        same error) ends the run with one line from the lead and exit code EXIT_FAILED."""
        # The step to start from, and the seed: the data order and the learning rate are
        # functions of those, so a resumed run continues bit for bit.
        extra = {"step": step + 1, "seed": self.args.seed}
        try:
            keep = self.args.keep_checkpoints or None  # 0: keep every checkpoint
            self.engine.save(self.args.out / CHECKPOINT, extra=extra, keep_last=keep)
        except zero_core.CheckpointError as exc:
            if self.lead:
                print(f"zero-train: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(EXIT_FAILED)

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        per_rank: torch.Tensor,
        stopping: bool,
    ) -> None:
        """Lead: the step's line of OUT/metrics.jsonl and its TensorBoard points, its
        history entry, and the progress bar or (every 5% of --steps, the last step, a stop)
        a plain line."""
        assert self.metrics is not None
        elapsed = time.perf_counter() - self.started
        rate = self.tokens_per_step * (step + 1 - self.first_step) / elapsed
        self.history.append((step, loss))
        table = per_rank.view(-1, RANK_STATS)
        self.step_seconds.append(float(table[:, 1].max()))
        record = {"step": step, "loss": loss, "lr": lr,
                  "tokens_per_s": round(rate, 1), "elapsed_s": round(elapsed, 2),
                  "step_s": round(float(table[:, 1].max()), 5),
                  "rss_mib": [round(float(v), 2) for v in table[:, 0]],
                  "grad_norm": grad_norm,
                  # every rank's sends, by link class (zero_comm.stats' ring convention)
                  "intra_node_bytes": int(table[:, 2].sum()),
                  "inter_node_bytes": int(table[:, 3].sum()),
                  "slot_s": [round(float(v), 5) for v in table[:, 4]]}  # fmt: skip
        self.metrics.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        memory = self.memory_mib
        if memory is None:  # (read before the step with the delayed update: optimizer_step)
            memory = self.engine.memory_report().total / 2**20
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(
                f"loss {loss:.4f}, {rate:.0f} tok/s, mem {memory:.1f} MiB", refresh=False
            )
        elif step % max(1, self.args.steps // 20) == 0 or step == self.end_step - 1 or stopping:
            print(f"step {step + 1:5d}/{self.args.steps}  loss {loss:.4f}  {rate:8.0f} tok/s  "
                  f"mem {memory:.1f} MiB", flush=True)  # fmt: skip

    def close_logs(self) -> None:
        """Lead: close the progress bar, OUT/metrics.jsonl (the report reads it back) and
        the TensorBoard writer (flushing its events)."""
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def exit_preempted(self, step: int) -> NoReturn:
        """After a stop at ``step`` (saved): the lead says how to go on; every rank closes
        its communicators and exits with EXIT_PREEMPTED."""
        if self.lead:
            received = self.preemption.received
            print(
                f"zero-train: {received.name if received else 'a signal'}"
                f" received: stopped after step {step + 1} of {self.args.steps}, saved "
                f"{self.args.out / CHECKPOINT}; the same command with --resume auto goes on "
                f"from there (exit code {EXIT_PREEMPTED})",
                flush=True,
            )
        self.run.close()
        sys.exit(EXIT_PREEMPTED)

    def finish(self) -> None:
        """Collective, after the last step: the report, each rank's peak memory per phase
        of the last step (the lead prints the table), then the communicators close."""
        args, run = self.args, self.run
        warn_overruns(run.padding, run.world.rank)
        report(args, self.engine, run.metrics_comm, run.mesh.tp, self.history, self.lead)
        phases = run.metrics_comm.all_gather_object(phase_record(run.tracker, run.checkpointing))
        if self.lead:
            virtual = getattr(args, "virtual_total", run.mesh.dp.world_size)
            micro_tokens = args.batch_size // virtual * run.config.context
            table = phase_table(phases, run.config, micro_tokens, args.tp, args.checkpoint)
            print("\n".join(table))
            if run.auto is not None:
                print(prediction_check(run.auto, self.step_seconds), flush=True)
        run.close()
