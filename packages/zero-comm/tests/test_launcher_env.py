"""Which launcher started a process, read from its environment (tier 1: pure functions).

Every test passes an explicit mapping to :func:`detect_launch_env`, so nothing here depends
on (or changes) the environment pytest itself runs in.
"""

from __future__ import annotations

import string
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import LaunchEnv, LaunchEnvError, detect_launch_env
from zero_comm.launcher_env import first_slurm_host


class LauncherVars(NamedTuple):
    """The names one launcher uses for rank, world size, local rank and local world size."""

    launcher: str
    rank: str
    size: str
    local_rank: str
    local_size: str


TORCHRUN = LauncherVars("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
OPENMPI = LauncherVars(
    "openmpi",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
MPICH = LauncherVars("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
SLURM = LauncherVars(
    "slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"
)
# In the order detect_launch_env tries them: the first one present wins.
LAUNCHERS = (TORCHRUN, OPENMPI, MPICH, SLURM)
BY_NAME = {v.launcher: v for v in LAUNCHERS}


class Place(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


@st.composite
def places(draw: st.DrawFn) -> Place:
    """A consistent place in a world: 0 <= rank < size, 0 <= local_rank < local_size."""
    world_size = draw(st.integers(1, 4096))
    rank = draw(st.integers(0, world_size - 1))
    local_world_size = draw(st.integers(1, 16))
    local_rank = draw(st.integers(0, local_world_size - 1))
    return Place(rank, world_size, local_rank, local_world_size)


def launcher_env(names: LauncherVars, place: Place) -> dict[str, str]:
    return {
        names.rank: str(place.rank),
        names.size: str(place.world_size),
        names.local_rank: str(place.local_rank),
        names.local_size: str(place.local_world_size),
    }


def expected(launcher: str, place: Place, addr: str | None, port: int | None) -> LaunchEnv:
    return LaunchEnv(
        launcher,
        place.rank,
        place.world_size,
        place.local_rank,
        place.local_world_size,
        addr,
        port,
    )


# ------------------------------------------------------------------ each launcher


def test_no_launcher_is_a_single_process() -> None:
    assert detect_launch_env({}) == LaunchEnv("none", 0, 1, 0, 1, None, None)


def test_unrelated_variables_are_a_single_process() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "SLURM_JOB_ID": "12", "OMP_NUM_THREADS": "4"}
    assert detect_launch_env(env) == LaunchEnv("none", 0, 1, 0, 1, None, None)


@settings(max_examples=200)
@given(names=st.sampled_from(LAUNCHERS), place=places())
def test_each_launcher_reports_its_variables(names: LauncherVars, place: Place) -> None:
    env = launcher_env(names, place)
    got = detect_launch_env(env)
    assert got == expected(names.launcher, place, None, None)
    assert got.under_mpi_launcher == (names.launcher in ("openmpi", "mpich"))


@settings(max_examples=100)
@given(names=st.sampled_from(LAUNCHERS), place=places())
def test_local_variables_default_to_rank_zero_of_the_whole_world(
    names: LauncherVars, place: Place
) -> None:
    """Without the local variables a launcher is taken to have put every rank on one host
    and this one first among them (local rank 0, local world size = world size)."""
    env = {names.rank: str(place.rank), names.size: str(place.world_size)}
    got = detect_launch_env(env)
    assert (got.launcher, got.rank, got.world_size) == (
        names.launcher,
        place.rank,
        place.world_size,
    )
    assert (got.local_rank, got.local_world_size) == (0, place.world_size)


@pytest.mark.parametrize("name", ["zero-launch", "custom-spawner"])
def test_zero_launcher_names_a_torchrun_style_launcher(name: str) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "ZERO_LAUNCHER": name}
    got = detect_launch_env(env)
    assert got.launcher == name
    assert (got.rank, got.world_size, got.local_rank) == (1, 2, 1)
    assert not got.under_mpi_launcher


def test_zero_launcher_alone_is_not_a_launcher() -> None:
    """ZERO_LAUNCHER only names the launcher of RANK/WORLD_SIZE; by itself it is nothing."""
    assert detect_launch_env({"ZERO_LAUNCHER": "zero-launch"}).launcher == "none"


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [v for names in LAUNCHERS for v in names[1:]] + [
        "MASTER_ADDR",
        "MASTER_PORT",
        "ZERO_LAUNCHER",
    ]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_PORT", "29511")
    got = detect_launch_env()
    assert (got.rank, got.world_size, got.master_port) == (2, 3, 29511)


# ---------------------------------------------------------------------- SLURM


def slurm_step(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4",
        "SLURM_JOB_ID": "123456",
    }
    env.update(extra)
    return env


def test_slurm_srun_step() -> None:
    env = slurm_step(SLURM_STEP_NODELIST="gpu[07-08]", SLURM_JOB_NODELIST="gpu[01-09]")
    got = detect_launch_env(env)
    # Port: 20000 + 123456 % 20000 = 20000 + 3456.
    assert got == LaunchEnv("slurm", 5, 8, 1, 4, "gpu07", 23456)
    assert not got.under_mpi_launcher


def test_slurm_master_addr_falls_back_to_the_job_node_list() -> None:
    got = detect_launch_env(slurm_step(SLURM_JOB_NODELIST="cpu[3,5],gpu1"))
    assert got.master_addr == "cpu3"


def test_slurm_without_node_list_or_job_id_has_no_master() -> None:
    env = slurm_step()
    del env["SLURM_JOB_ID"]
    got = detect_launch_env(env)
    assert (got.master_addr, got.master_port) == (None, None)


@given(job_id=st.integers(0, 10**12))
def test_slurm_port_is_derived_from_the_job_id(job_id: int) -> None:
    """Every task of a step computes the same port, always an unprivileged one below 40000."""
    got = detect_launch_env(slurm_step(SLURM_JOB_ID=str(job_id)))
    assert got.master_port == 20000 + job_id % 20000
    assert got.master_port is not None and 20000 <= got.master_port < 40000


@pytest.mark.parametrize("tasks_per_node", ["2(x4)", "3,2,3", ""])
def test_slurm_uneven_tasks_per_node_means_local_size_is_the_world(tasks_per_node: str) -> None:
    """SLURM writes uneven layouts as ``2(x4)`` or ``3,2,3``: not a single number, so the
    local world size falls back to the world size instead of failing."""
    got = detect_launch_env(slurm_step(SLURM_STEP_TASKS_PER_NODE=tasks_per_node))
    assert got.local_world_size == 8


@pytest.mark.parametrize(
    "batch_env",
    [
        {"SLURM_PROCID": "0", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-4]"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NNODES": "2"},
    ],
)
def test_slurm_batch_script_is_a_single_process(batch_env: dict[str, str]) -> None:
    """The batch script has SLURM_PROCID but no SLURM_STEP_NUM_TASKS: it is one process,
    not rank 0 of a world whose other ranks never start."""
    got = detect_launch_env(batch_env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == ("none", 0, 1, 0)


# ------------------------------------------------------------------ precedence


@settings(max_examples=200)
@given(
    present=st.lists(st.sampled_from(LAUNCHERS), min_size=1, max_size=4, unique=True),
    place_list=st.lists(places(), min_size=4, max_size=4),
)
def test_first_launcher_in_precedence_order_wins(
    present: list[LauncherVars], place_list: list[Place]
) -> None:
    """With several launchers' variables present (each with its own values), the result is
    the first one in the order torchrun, Open MPI, MPICH, SLURM: all of it, none mixed in."""
    env: dict[str, str] = {}
    for names, place in zip(present, place_list[: len(present)], strict=True):
        env.update(launcher_env(names, place))
    winner = min(present, key=LAUNCHERS.index)
    place = place_list[present.index(winner)]
    assert detect_launch_env(env) == expected(winner.launcher, place, None, None)


@pytest.mark.parametrize("mpi", [OPENMPI, MPICH], ids=lambda v: v.launcher)
def test_mpirun_inside_a_slurm_allocation_is_mpi(mpi: LauncherVars) -> None:
    """``mpirun`` inside ``salloc``/``sbatch`` inherits the step's SLURM variables, and an
    srun-launched MPI job has both; the MPI variables describe the world that exists."""
    env = slurm_step(SLURM_STEP_NODELIST="gpu[07-08]")
    env.update(launcher_env(mpi, Place(2, 3, 0, 1)))
    got = detect_launch_env(env)
    assert got.launcher == mpi.launcher
    assert got.under_mpi_launcher
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (2, 3, 0, 1)


# ------------------------------------------------------------ MASTER_ADDR / PORT


@given(
    names=st.sampled_from((*LAUNCHERS, None)),
    addr=st.sampled_from(["10.0.0.7", "node-12.cluster", "::1"]),
    port=st.integers(1, 65535),
)
def test_master_addr_and_port_are_read_for_every_launcher(
    names: LauncherVars | None, addr: str, port: int
) -> None:
    env = {} if names is None else launcher_env(names, Place(0, 2, 0, 2))
    env.update(
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        SLURM_JOB_ID="99",
        SLURM_STEP_NODELIST="slurmhost[1-2]",
    )
    got = detect_launch_env(env)
    # Explicit values win over the ones SLURM would derive.
    assert (got.master_addr, got.master_port) == (addr, port)


def test_empty_master_variables_are_unset() -> None:
    got = detect_launch_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert (got.master_addr, got.master_port) == (None, None)


def test_slurm_derives_only_the_missing_half_of_the_master() -> None:
    got = detect_launch_env(slurm_step(SLURM_STEP_NODELIST="a[3-4]", MASTER_PORT="29500"))
    assert (got.master_addr, got.master_port) == ("a3", 29500)
    got = detect_launch_env(slurm_step(SLURM_STEP_NODELIST="a[3-4]", MASTER_ADDR="10.1.1.1"))
    assert (got.master_addr, got.master_port) == ("10.1.1.1", 23456)


@pytest.mark.parametrize("port", ["http", "29500.0", "0x7530"])
def test_non_integer_master_port_is_an_error_naming_it(port: str) -> None:
    with pytest.raises(LaunchEnvError, match="MASTER_PORT") as info:
        detect_launch_env({"MASTER_PORT": port})
    assert repr(port) in str(info.value)


# ---------------------------------------------------------------------- errors


def every_variable() -> list[tuple[LauncherVars, str]]:
    return [(names, var) for names in LAUNCHERS for var in names[1:4]] + [
        (TORCHRUN, "LOCAL_WORLD_SIZE"),
        (OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        (MPICH, "MPI_LOCALNRANKS"),
    ]


@pytest.mark.parametrize(
    ("names", "var"), every_variable(), ids=lambda x: x if isinstance(x, str) else x.launcher
)
@pytest.mark.parametrize("bad", ["x", "1.5", "3 ranks"])
def test_non_integer_variable_is_an_error_naming_it(
    names: LauncherVars, var: str, bad: str
) -> None:
    env = launcher_env(names, Place(0, 2, 0, 2))
    env[var] = bad
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env(env)
    message = str(info.value)
    assert var in message
    assert repr(bad) in message


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "0"}, "PMI_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE"),
        ({"RANK": "", "WORLD_SIZE": "2"}, "RANK"),
        ({"SLURM_PROCID": "", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID"),
        ({"OMPI_COMM_WORLD_RANK": "", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ],
)
def test_missing_variable_is_an_error_naming_it(env: dict[str, str], missing: str) -> None:
    with pytest.raises(LaunchEnvError, match=missing):
        detect_launch_env(env)


OUT_OF_RANGE = [
    pytest.param(
        names,
        field,
        place,
        id=f"{names.launcher}-{field}={place.rank},{place.world_size},{place.local_rank}",
    )
    for names in LAUNCHERS
    for field, place in [
        ("rank", Place(4, 4, 0, 1)),
        ("rank", Place(-1, 4, 0, 1)),
        ("size", Place(0, 0, 0, 1)),
        ("local_rank", Place(0, 4, 2, 2)),
    ]
]


def _place_env(names: LauncherVars, place: Place) -> dict[str, str]:
    env = launcher_env(names, place)
    if names is SLURM:
        env["SLURM_STEP_TASKS_PER_NODE"] = str(place.local_world_size)
    return env


@pytest.mark.parametrize(("names", "field", "place"), OUT_OF_RANGE)
def test_out_of_range_values_are_errors(names: LauncherVars, field: str, place: Place) -> None:
    """A rank outside the world, an empty world and a local rank outside the host are
    rejected, and the message says which launcher gave the bad value and what it was."""
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env(_place_env(names, place))
    message = str(info.value)
    assert names.launcher in message
    bad = {"rank": place.rank, "size": place.world_size, "local_rank": place.local_rank}[field]
    assert str(bad) in message


@pytest.mark.parametrize(
    ("names", "field", "place"),
    [OUT_OF_RANGE[0], OUT_OF_RANGE[4 + 2], OUT_OF_RANGE[8 + 3], OUT_OF_RANGE[12 + 1]],
)
def test_out_of_range_errors_name_the_variable(
    names: LauncherVars, field: str, place: Place
) -> None:
    var = {"rank": names.rank, "size": names.size, "local_rank": names.local_rank}[field]
    with pytest.raises(LaunchEnvError, match=var):
        detect_launch_env(_place_env(names, place))


def test_launch_env_error_is_a_value_error() -> None:
    """Callers that catch ValueError for bad configuration also catch this one."""
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "two"})


# ------------------------------------------------------------- SLURM node lists


class HostGroup(NamedTuple):
    """One comma-separated item of a node list: ``prefix`` or ``prefix[ranges]``."""

    prefix: str
    ranges: tuple[tuple[str, str | None], ...]  # (low, high or None), as written

    def render(self) -> str:
        if not self.ranges:
            return self.prefix
        items = ",".join(lo if hi is None else f"{lo}-{hi}" for lo, hi in self.ranges)
        return f"{self.prefix}[{items}]"

    def first_host(self) -> str:
        """What SLURM's hostlist expansion lists first: the low end of the first range,
        with its zero padding."""
        return self.prefix + (self.ranges[0][0] if self.ranges else "")


@st.composite
def host_groups(draw: st.DrawFn) -> HostGroup:
    first = draw(st.sampled_from(string.ascii_lowercase))
    prefix = first + draw(st.text(string.ascii_lowercase + string.digits + "._-", max_size=11))
    n_ranges = draw(st.integers(0, 4))
    if n_ranges == 0:
        return HostGroup(prefix, ())
    width = draw(st.integers(1, 4))
    ranges = []
    for _ in range(n_ranges):
        lo = draw(st.integers(0, 10**width - 1))
        hi = draw(st.none() | st.integers(lo, 10**width - 1))
        ranges.append((f"{lo:0{width}d}", None if hi is None else f"{hi:0{width}d}"))
    return HostGroup(prefix, tuple(ranges))


@settings(max_examples=200)
@given(
    groups=st.lists(host_groups(), min_size=1, max_size=5),
    pad=st.sampled_from(["", " ", "\n", " \t"]),
)
def test_first_slurm_host_is_the_first_host_of_the_expanded_list(
    groups: list[HostGroup], pad: str
) -> None:
    """Zero padding is kept (``gpu[007-009]`` starts with ``gpu007``), later groups and
    later ranges are ignored, surrounding whitespace is stripped."""
    nodelist = pad + ",".join(g.render() for g in groups) + pad
    assert first_slurm_host(nodelist) == groups[0].first_host()


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("node1", "node1"),
        ("a,b,c", "a"),
        ("nid[001234-001240]", "nid001234"),
        ("login-[2,5-7]", "login-2"),
        ("host.example.org", "host.example.org"),
    ],
)
def test_first_slurm_host_examples(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node[1-2]-ib", "node1-ib"), ("rack[1-2]-node[01-04]", "rack1-node01")],
)
def test_first_slurm_host_keeps_the_suffix_after_a_range(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "   ", "[1-4]", ",node1"])
def test_unparseable_node_list_is_an_error_suggesting_master_addr(nodelist: str) -> None:
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR") as info:
        first_slurm_host(nodelist)
    assert repr(nodelist) in str(info.value)


def test_unparseable_slurm_node_list_fails_detection() -> None:
    with pytest.raises(LaunchEnvError, match="node list"):
        detect_launch_env(slurm_step(SLURM_STEP_NODELIST="[1-4]"))


def test_unparseable_slurm_node_list_is_ignored_with_master_addr() -> None:
    got = detect_launch_env(slurm_step(SLURM_STEP_NODELIST="[1-4]", MASTER_ADDR="10.0.0.1"))
    assert got.master_addr == "10.0.0.1"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
    ],
)
def test_half_a_launcher_environment_is_an_error_not_a_single_process(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        detect_launch_env(environ)
