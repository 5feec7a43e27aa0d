"""zero-train's options: the command line, a --config file, and every check that can fail
before a rank starts, so that a wrong option ends in one line of usage, not a traceback
from every rank.

The results folder (``--out``) belongs to one run: a new run refuses a folder that holds
another run's results unless told ``--resume auto`` (continue it) or ``--overwrite``
(replace it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import zero_core
from zero_comm.comm_options import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S
from zero_comm.launcher_env import detect_launch_env
from zero_core.checkpoint.reader import CheckpointReader
from zero_core.command_line import CommandLineParser

from .checkpoint_plan import CHECKPOINT_MODES
from .data import UINT16_SUFFIXES, load_tokens, token_count
from .gpt import PRESETS, GPTConfig
from .hetero_options import (
    LIST_OPTIONS,
    add_hetero_options,
    hetero_settings,
    list_flag,
    resolve_virtual_ranks,
)
from .run_lock import busy_message, holder_of, owns_the_run
from .run_tensorboard import INSTALL_HINT as TENSORBOARD_HINT
from .run_tensorboard import tensorboard_available
from .tp_plan import check_tp_degree
from .train_engine_config import (
    DTYPES,
    HIERARCHY_FLAGS,
    apply_deepspeed,
    check_hierarchy,
    engine_settings,
    hierarchy_settings,
    offload_error,
    run_zero_config,
)

THREADS_PER_CORE = 4  # --threads above this many per core: a typo (100000 crashed gloo)
HIGHEST_STAGE = max(zero_core.AVAILABLE_STAGES)
CHECKPOINT = "checkpoint"  # OUT/checkpoint: where --save-every and a preemption save
TENSORBOARD = "tensorboard"  # OUT/tensorboard: --tensorboard's event files, by default
RESULTS = ("metrics.jsonl", CHECKPOINT, "loss.png", TENSORBOARD)  # what a run leaves in OUT
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped by a signal, saved; run again to go on
EXIT_FAILED = 3  # an error every rank met and rank 0 explained in one line (a failed save)
DESCRIPTION = "Train a GPT with ZeRO on the default corpus, or on your data."


def newest_checkpoint(folder: Path) -> Path | None:
    """``folder`` if a complete checkpoint was saved there: the one ``folder/latest``
    names, or ``folder`` itself as saved before tags (engine.load follows the same rule,
    and falls back to a ``.old`` twin if a save was cut off while swapping); None if not.
    Raises CheckpointError where ``latest`` names a checkpoint that is not complete."""
    return folder if zero_core.complete_checkpoint(folder) is not None else None


def earlier_results(out: Path) -> list[str]:
    """What another run left in ``out`` (names from RESULTS), in RESULTS order."""
    return [name for name in RESULTS if (out / name).exists()]


def preempt_signals(text: str) -> tuple[signal.Signals, ...]:
    """'TERM,USR1' -> (SIGTERM, SIGUSR1); 'none' -> ()."""
    if text.strip().lower() == "none":
        return ()
    chosen = []
    for name in text.split(","):
        full = "SIG" + name.strip().upper().removeprefix("SIG")
        if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
            raise ValueError(
                f"--preempt-signals {text}: {name.strip()!r} is not a signal that can be "
                "caught; give names like TERM,USR1,USR2 or none"
            )
        chosen.append(signal.Signals[full])
    return tuple(chosen)


def parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="zero-train", description=DESCRIPTION)
    p.add_argument("--config", type=Path, help="JSON file of option values (flags override it)")
    p.add_argument(
        "--deepspeed", type=Path, metavar="FILE",
        help="a DeepSpeed config (JSON): its stage, precision, batch sizes, clipping, "
        "optimizer and scheduler replace the flags; its 'auto' values take the flags'",
    )  # fmt: skip
    p.add_argument("--stage", type=int, default=HIGHEST_STAGE, help="ZeRO stage (default: highest)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks when run by hand")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides ranks)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "mpi", "auto"))
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    for name in ("layers", "heads", "width", "context"):
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument(
        "--reduce-dtype", choices=sorted(DTYPES),
        help="dtype gradients are reduced and accumulated in (ZeroConfig.reduce_dtype): fp32 "
        "with --dtype bf16 or fp16 is FSDP2's reduce_dtype=torch.float32 (default: --dtype)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint", default="none", choices=CHECKPOINT_MODES,
        help="activation checkpointing of the blocks; partitioned = ZeRO-R's P_a over --tp",
    )  # fmt: skip
    p.add_argument(
        "--offload-checkpoints", action="store_true",
        help="keep activation checkpoints in host memory (P_a+cpu; needs --checkpoint)",
    )  # fmt: skip
    p.add_argument(
        "--offload-optimizer", default="none", choices=("none", "cpu", "disk"),
        help="where master weights and optimizer states live (stages 1-3): the device, host "
        "memory, or swap files in --offload-dir (ZeRO-Offload / ZeRO-Infinity)",
    )  # fmt: skip
    p.add_argument(
        "--offload-params", default="none", choices=("none", "cpu", "disk"),
        help="stage 3: where each rank's parameter shards live between uses",
    )  # fmt: skip
    p.add_argument(
        "--no-offload-gradients", dest="offload_gradients", action="store_false",
        help="keep reduced gradients on the device when --offload-optimizer moves the "
        "optimizer (by default they follow its tier, at stages 2 and 3)",
    )  # fmt: skip
    p.add_argument(
        "--offload-dir", type=Path, metavar="DIR",
        help="folder of the swap files of the disk tiers (checked for space before training)",
    )  # fmt: skip
    p.add_argument(
        "--shard-group", type=int, metavar="S",
        help="stages 1-3: hybrid sharding (MiCS/HSDP): partition model states over groups of "
        "S consecutive data-parallel ranks (e.g. one node's) and replicate across groups "
        "(-1: all ranks, no hybrid sharding)",
    )  # fmt: skip
    p.add_argument(
        "--hpz", type=int, default=1, metavar="P",
        help="stage 3 (ZeRO++ hpZ): keep a secondary parameter copy over groups of P ranks "
        "(one node) so backward gathers stay inside them; 1: off",
    )  # fmt: skip
    p.add_argument(
        "--quantize-weights", action="store_true",
        help="stage 3 (ZeRO++ qwZ): int8 block-quantized forward parameter all-gathers",
    )  # fmt: skip
    p.add_argument(
        "--quantize-gradients", choices=("int4", "int8"),
        help="stages 2-3 (ZeRO++ qgZ): gradients reduced by a quantized hierarchical all-to-all",
    )  # fmt: skip
    p.add_argument(
        "--optimizer-in-backward", action="store_true",
        help="stage 3: step each gradient bucket's optimizer shard as soon as backward has "
        "reduced it (12 bytes per parameter / N instead of 16; the same bits); needs --clip 0 "
        "and --grad-accum 1, and raises on a NaN instead of skipping the step",
    )  # fmt: skip
    p.add_argument(
        "--delayed-parameter-update", action="store_true",
        help="ZeRO-Offload's one-step delayed parameter update: step t's optimizer update "
        "runs on the host in the background while step t+1 computes with the parameters "
        "before it; needs --offload-optimizer cpu or disk (docs/offload.md)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--batch-size", type=int, default=16,
        help="sequences per micro-step over all data-parallel ranks (a step takes "
        "--grad-accum of them)",
    )  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    add_hetero_options(p)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="text file, folder, or .bin/.u16 uint16 tokens")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/zero-train"),
        help="folder for metrics, plot and checkpoint (one run's; see --overwrite)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of another run found in --out"
    )
    p.add_argument(
        "--tensorboard", nargs="?", const="", metavar="DIR",
        help="rank 0 also writes TensorBoard event files to DIR (default OUT/tensorboard): "
        "loss, learning rate, tokens/s, gradient norm and memory per rank at every step; "
        f"needs {TENSORBOARD_HINT}",
    )  # fmt: skip
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also save a checkpoint to OUT/checkpoint/global_step<N> every N steps (0: only "
        "at the end); OUT/checkpoint/latest names the last",
    )
    p.add_argument(
        "--keep-checkpoints", type=int, default=1, metavar="K",
        help="keep the newest K checkpoints in OUT/checkpoint, removing older ones after "
        "each save (default 1; 0 keeps every one)",
    )  # fmt: skip
    p.add_argument(
        "--final-save", action=argparse.BooleanOptionalAction,
        help="save OUT/checkpoint after the last step, for --resume auto and "
        "zero-consolidate (the default, but with --tp; --no-final-save skips it)",
    )  # fmt: skip
    p.add_argument(
        "--resume", type=Path, metavar="CKPT|auto",
        help="continue from this checkpoint (any stage, ranks); auto: from OUT/checkpoint if "
        "there is one, else from the start, replacing what a run without a checkpoint left "
        "in OUT (a requeued job needs no edit)",
    )  # fmt: skip
    p.add_argument(
        "--preempt-signals", default="TERM,USR1", metavar="SIGNALS",
        help="signals that make every rank finish its step, save OUT/checkpoint and exit "
        f"with code {EXIT_PREEMPTED} (SLURM sends TERM; --signal=USR1@90 asks for USR1); "
        "'none' to leave them fatal",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int,
        help="intra-op threads per rank (default: OMP_NUM_THREADS, else this node's cores / "
        "its ranks); results are bitwise reproducible only at the same count",
    )  # fmt: skip
    p.add_argument(
        "--comm-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help="how long a rank waits in a collective for peers that are alive and beating "
        f"before it stops, naming what it can see of them (default {DEFAULT_TIMEOUT_S:g}; "
        "a dead peer of this host, or one that exited, is named at once)",
    )  # fmt: skip
    p.add_argument(
        "--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a peer may go without a heartbeat (stopped, swapped out, hung) before "
        f"a rank waiting on it stops, naming it (default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})",
    )  # fmt: skip
    p.add_argument(
        "--stop-after", type=int, metavar="STEP",
        help="end after this step, as if cut off there: the schedule stays that of --steps",
    )  # fmt: skip
    return p


def config_flags(p: argparse.ArgumentParser, path: Path) -> list[str]:
    """The --config JSON file as flags, to go before the command line's (which win):
    {"steps": 7, "batch_size": 4} -> ["--steps", "7", "--batch-size", "4"]. Each value is
    then checked by its option like a typed flag; anything else stops with usage."""
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--config {path}: cannot read a JSON object from it ({exc})")
    if not isinstance(values, dict):
        p.error(f"--config {path}: must hold a JSON object of option values, not {values!r}")
    options = {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(str(k) for k in set(values) - set(options))
    if unknown:
        p.error(f"--config {path}: unknown keys {unknown}")
    flags: list[str] = []
    for key, value in values.items():
        option = options[key]
        if option.nargs == 0:  # a switch: true turns it on, false off
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key}={value!r} must be true or false")
            on, *off = option.option_strings  # BooleanOptionalAction: [--x, --no-x]
            flags += [on] if value else off[:1]
            continue
        if key == "config":
            p.error(f"--config {path}: a config cannot name another config (key 'config')")
        if key in LIST_OPTIONS and isinstance(value, list):
            try:
                value = list_flag(key, value)
            except ValueError as exc:
                p.error(f"--config {path}: {exc}")
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            p.error(f"--config {path}: {key}={value!r} must be a number or text")
        flags += [option.option_strings[0], str(value)]
    return flags


def parse_options(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options from --config, then flags; every check that can fail before launching."""
    p = parser()
    args = p.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if args.config is not None:
        given = [*config_flags(p, args.config), *given]
        args = p.parse_args(given)
    args.given = given_options(given)
    if args.stage not in (0, 1, 2, 3):
        p.error(f"--stage {args.stage}: ZeRO stages are 0-3")
    if args.nproc < 1 or args.steps < 1 or args.grad_accum < 1 or args.batch_size < 1:
        p.error("--nproc, --steps, --grad-accum and --batch-size must be at least 1")
    if args.offload_checkpoints and args.checkpoint == "none":
        p.error("--offload-checkpoints needs --checkpoint full or --checkpoint partitioned")
    offload_problem = offload_error(args)
    if offload_problem:
        p.error(offload_problem)
    try:
        zero_core.ZeroConfig(stage=args.stage, **hierarchy_settings(args))
    except ValueError as exc:
        p.error(f"{HIERARCHY_FLAGS}: {exc}")
    if args.reduce_dtype is not None and args.deepspeed is not None:
        p.error(
            "--reduce-dtype with --deepspeed: the DeepSpeed config sets the engine's precision "
            "(DeepSpeed's name for this is communication_data_type); drop one of them"
        )
    if args.reduce_dtype is not None:
        try:
            zero_core.ZeroConfig(param_dtype=DTYPES[args.dtype], reduce_dtype=args.reduce_dtype)
        except ValueError as exc:
            p.error(f"--reduce-dtype: {exc}")
    if args.optimizer_in_backward and args.deepspeed is not None:
        p.error(
            "--optimizer-in-backward with --deepspeed: a DeepSpeed config has no such key and "
            "sets the engine itself (clipping, accumulation); drop one of them"
        )
    if args.optimizer_in_backward:
        try:
            zero_core.ZeroConfig(**engine_settings(args))
        except ValueError as exc:
            p.error(
                f"--optimizer-in-backward: {exc} (zero-train: --stage 3 --clip 0 --grad-accum 1, "
                "--dtype fp32 or bf16, no --offload-*)"
            )
    if args.delayed_parameter_update and args.deepspeed is None:
        try:
            zero_core.ZeroConfig(**engine_settings(args))
        except ValueError as exc:
            p.error(f"--delayed-parameter-update: {exc} (zero-train: --offload-optimizer cpu)")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after {args.stop_after} must be a step from 1 to --steps ({args.steps})")
    if not 0 < args.comm_timeout < math.inf:
        p.error(f"--comm-timeout {args.comm_timeout} must be a number of seconds > 0")
    if not 0 < args.heartbeat_timeout < math.inf:
        p.error(f"--heartbeat-timeout {args.heartbeat_timeout} must be a number of seconds > 0")
    if args.keep_checkpoints < 0:
        p.error(f"--keep-checkpoints {args.keep_checkpoints} must be 0 (keep all) or more")
    if args.save_every < 0:
        p.error(f"--save-every {args.save_every} must be 0 (only at the end) or a number of steps")
    if args.tp > 1 and (args.save_every or args.final_save or args.resume is not None):
        p.error(
            f"--tp {args.tp} with --save-every/--final-save/--resume: checkpoints of "
            "tensor-parallel runs are not supported yet; drop those options or use --tp 1"
        )
    if args.final_save is None:
        args.final_save = args.tp == 1  # a --tp run cannot save (above): it trains unsaved
    if args.lr <= 0 or not math.isfinite(args.lr):
        p.error(f"--lr {args.lr} must be a positive learning rate, e.g. --lr 3e-3")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup} must be 0 or more steps")
    if not 0 <= args.clip < math.inf:
        p.error(f"--clip {args.clip} must be a gradient norm >= 0 (--clip 0 turns clipping off)")
    if args.sample_tokens < 0:
        p.error(f"--sample-tokens {args.sample_tokens} must be 0 (no sample) or more")
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > THREADS_PER_CORE * cores:
        p.error(
            f"--threads {args.threads} is more than {THREADS_PER_CORE} per core of the {cores} "
            "here; give at most the cores a rank may use"
        )
    backend_problem = backend_error(args)
    if backend_problem:
        p.error(backend_problem)
    try:
        args.preempt_signals = preempt_signals(args.preempt_signals)
    except ValueError as exc:
        p.error(str(exc))
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file; name a folder for the run's results")
    if args.tensorboard is not None:
        # Given alone (or empty, from --config): OUT/tensorboard.
        args.tensorboard = Path(args.tensorboard or args.out / TENSORBOARD)
        if not tensorboard_available():
            p.error(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")
        if args.tensorboard.exists() and not args.tensorboard.is_dir():
            p.error(f"--tensorboard {args.tensorboard} is a file; name a folder for the events")
    if owns_the_run(args.out):  # before --resume auto or --overwrite may touch anything
        holder = holder_of(args.out)
        if holder:
            p.error(busy_message(args.out, holder))
    args.fresh_after_auto = False
    wanted = args.out / CHECKPOINT if str(args.resume) == "auto" else args.resume
    try:
        found_checkpoint = None if wanted is None else newest_checkpoint(wanted)
    except zero_core.CheckpointError as exc:  # a 'latest' naming a missing checkpoint
        p.error(f"--resume {args.resume}: {exc}")
    if str(args.resume) == "auto":
        args.resume = found_checkpoint
        # No checkpoint to go on from: start over, in place of what is there (a job
        # requeued before its first save; the help's promise).
        args.fresh_after_auto = args.resume is None
    elif args.resume is not None and found_checkpoint is None:
        p.error(f"--resume {args.resume}: no checkpoint there (no latest, no index.json)")
    if args.resume is not None:
        try:  # its index and files, before the ranks start (their values: in the load)
            CheckpointReader(args.resume).check_files()
        except zero_core.CheckpointError as exc:
            p.error(f"--resume {args.resume}: {exc}")
    found = earlier_results(args.out)
    if found and args.resume is None and not (args.overwrite or args.fresh_after_auto):
        p.error(
            f"--out {args.out} holds the results of another run ({', '.join(found)}); "
            "continue it with --resume auto, replace it with --overwrite, or name another --out"
        )
    try:
        config = model_config(args)
        if args.data is not None:
            check_data(args.data, config)
        if args.tp < 1:
            raise ValueError(f"--tp {args.tp} must be at least 1")
        launcher = detect_launch_env()
        world = args.nproc if launcher.launcher == "none" else launcher.world_size
        if world % args.tp:
            raise ValueError(
                f"--tp {args.tp} does not divide the {world} ranks; use --nproc (or -n) that is "
                f"a multiple of {args.tp}"
            )
        data_parallel = world // args.tp
        check_hierarchy(args, data_parallel)
        virtual = resolve_virtual_ranks(args, data_parallel)
        check_tp_degree(config.heads, config.width, max(config.vocab_size, 256), args.tp)
        if args.deepspeed is not None:
            apply_deepspeed(args, virtual)
            check_hierarchy(args, data_parallel)
        hetero = hetero_settings(args)
        if hetero and args.deepspeed is None:
            try:
                zero_core.ZeroConfig(**engine_settings(args))
            except ValueError as exc:
                raise ValueError(f"--micro-batches-per-rank/--shard-weights: {exc}") from None
        elif hetero:
            run_zero_config(args)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    try:  # last: every check passed; the ranks would make it, and fail in a traceback each
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {args.out}: cannot make the results folder ({exc.strerror}); name "
                "a folder you can write")  # fmt: skip
    return args


def backend_error(args: argparse.Namespace) -> str:
    """What makes --backend fail in every rank ("" if nothing): NCCL without a GPU, MPI
    without an MPI launcher (zero-train's own ranks are zero-launch's, not MPI's)."""
    if args.backend == "nccl" and not torch.cuda.is_available():
        return "--backend nccl needs CUDA GPUs and torch sees none here: use --backend gloo"
    if args.backend == "mpi" and detect_launch_env().launcher == "none" and args.nproc > 1:
        return (
            f"--backend mpi needs an MPI launcher: mpiexec -n {args.nproc} python -m mpi4py "
            "-m zero_models.train --backend mpi (zero-train --nproc starts gloo ranks)"
        )
    return ""


def check_data(source: str, config: GPTConfig) -> None:
    """What the ranks would find wrong with ``--data``, found before they start: missing,
    empty, an odd-sized token file, fewer tokens than one sequence, a token id beyond the
    model's vocabulary."""
    tokens = token_count(source)
    if tokens < config.context + 2:
        raise ValueError(
            f"--data {source}: {tokens} tokens, and a sequence of --context {config.context} "
            f"needs {config.context + 2}: give more data or a smaller --context"
        )
    if Path(source).suffix in UINT16_SUFFIXES:
        largest = int(load_tokens(source).max())
        if largest >= max(config.vocab_size, 256):
            raise ValueError(
                f"--data {source}: token id {largest} is beyond the model's vocabulary of "
                f"{config.vocab_size}: choose a --model whose vocabulary holds it (gpt2's "
                f"has {PRESETS['gpt2'].vocab_size}), or tokenise with a smaller one"
            )


def given_options(argv: Sequence[str]) -> set[str]:
    """The options ``argv`` sets itself (their dests), as against their defaults."""
    bare = parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    return set(vars(bare.parse_args(list(argv))))


def model_config(args: argparse.Namespace) -> GPTConfig:
    return PRESETS[args.model].with_overrides(
        layers=args.layers, heads=args.heads, width=args.width, context=args.context
    )


def threads_per_rank(requested: int | None, local_ranks: int) -> tuple[int, str]:
    """The intra-op threads each rank computes with, and where the number came from:
    --threads, else OMP_NUM_THREADS, else this node's cores shared among its ranks."""
    cores = os.cpu_count() or 1
    shared = max(1, cores // max(1, local_ranks))
    if requested is not None:
        return requested, "--threads"
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) >= 1:
        if int(value) == shared:
            return shared, f"{cores} cores / {local_ranks} ranks on this node"
        return int(value), "OMP_NUM_THREADS"
    return shared, f"{cores} cores / {local_ranks} ranks on this node"
