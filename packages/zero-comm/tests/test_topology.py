"""Topology: which ranks share a node, the subgroups it gives, and the stats split by link.

Tier 1 (pure): Topology, the launcher's variables -> node key, the choice among sources
from every rank's evidence, and CommStats' intra-/inter-node rule. Tier 2 (simulated
worlds): set_topology, the intra-node, inter-node, shard and replica communicators, and the
split a communicator records. Real processes: tests/distributed/test_topology_ranks.py.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_comm import CommStats, Communicator, LaunchEnvError, ring_volume, run_simulated
from zero_comm.launcher_env import NodeKey, node_key_from_env
from zero_comm.simulated import SimulatedRankError
from zero_comm.topology import NodeEvidence, Topology, divisors, topology_from_evidence
from zero_comm.world import detect_topology

RING = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

# ------------------------------------------------------------------ Topology


@given(nodes=st.integers(1, 6), per_node=st.integers(1, 5))
def test_uniform_is_node_major(nodes: int, per_node: int) -> None:
    size = nodes * per_node
    topo = Topology.uniform(size, per_node)
    assert topo.node_of == tuple(r // per_node for r in range(size))
    assert (topo.num_nodes, topo.ranks_per_node, topo.world_size) == (nodes, per_node, size)
    assert topo.nodes == tuple(range(nodes))
    for node in range(nodes):
        ranks = topo.local_ranks(node)
        assert ranks == tuple(range(node * per_node, (node + 1) * per_node))
        assert [topo.local_index(r) for r in ranks] == list(range(per_node))
    for a in range(size):
        for b in range(size):
            assert topo.same_node(a, b) == (a // per_node == b // per_node)


def test_uniform_that_does_not_divide_names_the_valid_sizes() -> None:
    with pytest.raises(ValueError, match=r"ranks_per_node=4 does not divide .* 6; use one of "
                       r"\[1, 2, 3, 6\]"):  # fmt: skip
        Topology.uniform(6, 4)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="ranks_per_node must be an int >= 1"):
            Topology.uniform(4, bad)  # type: ignore[arg-type]


def test_single_node_and_unequal_nodes() -> None:
    one = Topology.single_node(3)
    assert (one.node_of, one.num_nodes, one.ranks_per_node, one.source) == (
        (0, 0, 0), 1, 3, "single-node"
    )  # fmt: skip
    uneven = Topology((0, 0, 0, 1))
    assert (uneven.num_nodes, uneven.ranks_per_node) == (2, None)
    assert uneven.local_ranks(1) == (3,)


@given(keys=st.lists(st.sampled_from("abcde"), min_size=1, max_size=12))
def test_from_keys_numbers_nodes_by_first_appearance(keys: list[str]) -> None:
    topo = Topology.from_keys(keys, "hostname")
    first = list(dict.fromkeys(keys))
    assert topo.node_of == tuple(first.index(k) for k in keys)
    assert topo.nodes == tuple(range(len(first)))
    assert topo.source == "hostname"


def test_restrict_keeps_the_world_node_numbers() -> None:
    world = Topology.uniform(6, 3, source="slurm")
    sub = world.restrict([2, 3, 5])
    assert (sub.node_of, sub.nodes, sub.source) == ((0, 1, 1), (0, 1), "slurm")
    assert world.restrict([4, 5]).node_of == (1, 1)
    with pytest.raises(ValueError, match=r"no rank of this communicator is on node 0; its "
                       r"nodes are \[1\]"):  # fmt: skip
        world.restrict([4, 5]).local_ranks(0)


def test_source_is_not_compared_and_bad_values_are_named() -> None:
    assert Topology((0, 1), "torchrun") == Topology((0, 1), "hostname")
    assert Topology([0, 1]).node_of == (0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is empty"):
        Topology(())
    with pytest.raises(ValueError, match="ints >= 0, got -1"):
        Topology((0, -1))
    with pytest.raises(ValueError, match="source='mpi' is not one of"):
        Topology((0,), "mpi")


# ------------------------------------------------------- launcher variables


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param(
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
             "GROUP_RANK": "1"},
            NodeKey("torchrun", 1, 1, 4, False), id="torchrun",
        ),
        pytest.param(
            {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
             "ZERO_LAUNCHER": "zero-launch"},
            NodeKey("torchrun", 0, 2, 4, True), id="zero-launch",
        ),
        pytest.param(
            {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
             "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
             "OMPI_COMM_WORLD_NODE_RANK": "2"},
            NodeKey("openmpi", 4, 2, 4, True), id="openmpi",
        ),
        pytest.param(
            {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "PMI_HOSTNAME": "n1"},
            NodeKey("mpich", 2, 1, 2, True), id="mpich",
        ),
        pytest.param(
            {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2"},
            NodeKey("slurm", 2, 1, 2, False), id="slurm",
        ),
        pytest.param(
            {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"},
            NodeKey("slurm", 2, 0, None, False), id="slurm-unequal-nodes",
        ),
        pytest.param(
            # mpirun inside a SLURM allocation inherits the batch node's SLURM_NODEID.
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
             "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0"},
            NodeKey("openmpi", 2, 1, 2, True), id="openmpi-in-slurm",
        ),
        pytest.param(
            # srun --mpi=pmi2 sets PMI_RANK but not Hydra's MPI_LOCALRANKID.
            {"PMI_RANK": "3", "PMI_SIZE": "4", "SLURM_PROCID": "3",
             "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"},
            NodeKey("slurm", 1, 1, None, False), id="srun-pmi2",
        ),
        pytest.param({}, None, id="no-launcher"),
        pytest.param({"RANK": "0", "WORLD_SIZE": "2"}, None, id="torchrun-vars-without-node"),
        pytest.param({"PMI_RANK": "0", "PMI_SIZE": "2"}, None, id="pmi-without-local-rank"),
        pytest.param({"SLURM_PROCID": "0", "SLURM_NODEID": "0"}, None, id="slurm-batch-script"),
    ],
)  # fmt: skip
def test_node_key_from_each_launcher(environ: dict[str, str], expected: NodeKey | None) -> None:
    assert node_key_from_env(environ) == expected


def test_a_node_variable_that_is_not_a_number_is_named() -> None:
    with pytest.raises(LaunchEnvError, match="GROUP_RANK='one' is not an integer"):
        node_key_from_env({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "one"})


# ------------------------------------------------- the choice among sources

LAUNCHERS = ("torchrun", "zero-launch", "openmpi", "mpich", "slurm")


def launcher_environ(launcher: str, rank: int, placement: list[int]) -> dict[str, str]:
    """What ``launcher`` sets for ``rank`` when rank r runs on node ``placement[r]``."""
    node, size = placement[rank], len(placement)
    local = placement[:rank].count(node)
    local_size = placement.count(node)
    counts = {placement.count(n) for n in placement}
    if launcher in ("torchrun", "zero-launch"):
        env = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(local_size)}  # fmt: skip
        if launcher == "torchrun":
            env["GROUP_RANK"] = str(node)
        return env
    if launcher == "openmpi":
        names = [f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
    elif launcher == "mpich":
        names = ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"]
    else:
        names = ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                 "SLURM_STEP_TASKS_PER_NODE"]  # fmt: skip
    env = dict(zip(names, map(str, (rank, size, local, local_size)), strict=True))
    if launcher == "slurm":
        env["SLURM_NODEID"] = str(node)
        if len(counts) > 1:
            env["SLURM_STEP_TASKS_PER_NODE"] = "3,1(x2)"  # SLURM's form for unequal nodes
    return env


def evidence(
    environs: list[dict[str, str]],
    hosts: list[str],
    shared_memory: list[int] | None = None,
) -> list[NodeEvidence]:
    return [
        NodeEvidence(
            env.get("ZERO_RANKS_PER_NODE"),
            node_key_from_env(env),
            None if shared_memory is None else shared_memory[r],
            hosts[r],
        )
        for r, env in enumerate(environs)
    ]


@st.composite
def placements(draw: st.DrawFn) -> list[int]:
    """Node of each rank: 1-4 nodes of 1-4 ranks, node-major blocks or shuffled."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    blocks = [node for node, count in enumerate(sizes) for _ in range(count)]
    placement = draw(st.permutations(blocks)) if draw(st.booleans()) else blocks
    # Launchers number nodes by their first rank (torchrun's GROUP_RANK, SLURM_NODEID);
    # renumbering keeps the property independent of that.
    order = list(dict.fromkeys(placement))
    return [order.index(n) for n in placement]


@settings(max_examples=300)
@given(placement=placements(), launcher=st.sampled_from(LAUNCHERS))
def test_detected_topology_is_the_placement_whatever_the_launcher(
    placement: list[int], launcher: str
) -> None:
    """Never a wrong topology: the launcher's where it describes the nodes (node-contiguous
    blocks, or a launcher that names nodes), else the host name, still right."""
    size = len(placement)
    environs = [launcher_environ(launcher, r, placement) for r in range(size)]
    topo = topology_from_evidence(evidence(environs, [f"host{n}" for n in placement]))
    assert topo.node_of == tuple(placement)
    blocks = placement == sorted(placement)
    names_nodes = launcher in ("torchrun", "slurm")
    if size == 1:
        assert topo.source == "single-node"
    elif blocks or names_nodes:
        assert topo.source == ("torchrun" if launcher == "zero-launch" else launcher)
    else:
        assert topo.source == "hostname"


def test_round_robin_mpi_mapping_falls_back_to_the_host_name() -> None:
    """mpirun --map-by node: ranks 0, 2 on one node, 1, 3 on the other; rank - local rank
    would put 1 and 2 together. The check sees it and the host names are used."""
    placement = [0, 1, 0, 1]
    environs = [launcher_environ("openmpi", r, placement) for r in range(4)]
    topo = topology_from_evidence(evidence(environs, ["a", "b", "a", "b"]))
    assert (topo.node_of, topo.source) == ((0, 1, 0, 1), "hostname")


def test_ranks_per_node_variable_wins_and_must_agree() -> None:
    environs = [dict(launcher_environ("mpich", r, [0] * 4), ZERO_RANKS_PER_NODE="2")
                for r in range(4)]  # fmt: skip
    topo = topology_from_evidence(evidence(environs, ["h"] * 4))
    assert (topo.node_of, topo.source) == ((0, 0, 1, 1), "ZERO_RANKS_PER_NODE")
    environs[3]["ZERO_RANKS_PER_NODE"] = "4"
    with pytest.raises(ValueError, match="ZERO_RANKS_PER_NODE differs between ranks"):
        topology_from_evidence(evidence(environs, ["h"] * 4))
    for raw, message in (("two", "is not an integer"), ("3", r"use one of \[1, 2, 4\]")):
        bad = [{"ZERO_RANKS_PER_NODE": raw}] * 4
        with pytest.raises(ValueError, match=message):
            topology_from_evidence(evidence(bad, ["h"] * 4))


def test_shared_memory_comes_after_the_launcher_and_before_the_host_name() -> None:
    no_launcher: list[dict[str, str]] = [{}] * 4
    topo = topology_from_evidence(evidence(no_launcher, ["h"] * 4, shared_memory=[0, 0, 2, 2]))
    assert (topo.node_of, topo.source) == ((0, 0, 1, 1), "mpi-shared-memory")
    mpich = [launcher_environ("mpich", r, [0, 0, 0, 0]) for r in range(4)]
    topo = topology_from_evidence(evidence(mpich, ["h"] * 4, shared_memory=[0, 0, 2, 2]))
    assert (topo.node_of, topo.source) == ((0, 0, 0, 0), "mpich")
    topo = topology_from_evidence(evidence(no_launcher, ["x", "y", "x", "y"]))
    assert (topo.node_of, topo.source) == ((0, 1, 0, 1), "hostname")


def test_launcher_variables_on_some_ranks_only_are_not_trusted() -> None:
    environs = [launcher_environ("mpich", r, [0, 0, 1, 1]) for r in range(4)]
    environs[3] = {}
    topo = topology_from_evidence(evidence(environs, ["a", "a", "b", "b"]))
    assert (topo.node_of, topo.source) == ((0, 0, 1, 1), "hostname")


def test_local_ranks_that_contradict_the_blocks_are_not_trusted() -> None:
    """Ranks 0 and 2 say local ranks 0 and 2 (so node 0), 1 and 3 say 0 and 2 (node 1),
    each with 2 ranks per node: the counts fit, but local rank 2 of 2 cannot be, and
    {0, 2} is no block. The host names are used instead."""
    environs = [
        {"PMI_RANK": str(r), "PMI_SIZE": "4", "MPI_LOCALRANKID": str(2 * (r // 2)),
         "MPI_LOCALNRANKS": "2"}
        for r in range(4)
    ]  # fmt: skip
    assert [node_key_from_env(e).node for e in environs] == [0, 1, 0, 1]  # type: ignore[union-attr]
    topo = topology_from_evidence(evidence(environs, ["a", "a", "b", "b"]))
    assert (topo.node_of, topo.source) == ((0, 0, 1, 1), "hostname")
    # torchrun's GROUP_RANK 0 everywhere, but 2 ranks per node: the counts do not fit.
    environs = [dict(launcher_environ("torchrun", r, [0, 0, 1, 1]), GROUP_RANK="0")
                for r in range(4)]  # fmt: skip
    topo = topology_from_evidence(evidence(environs, ["a", "a", "b", "b"]))
    assert (topo.node_of, topo.source) == ((0, 0, 1, 1), "hostname")


def test_detect_topology_gathers_every_rank_evidence() -> None:
    """The collective path of init, on a simulated world: each rank reads its own variables."""
    placement = [0, 0, 1, 1]

    def body(comm: Communicator) -> tuple[tuple[int, ...], str]:
        topo = detect_topology(comm, environ=launcher_environ("torchrun", comm.rank, placement))
        fixed = detect_topology(comm, ranks_per_node=1)
        assert (fixed.node_of, fixed.source) == ((0, 1, 2, 3), "argument")
        return topo.node_of, topo.source

    assert run_simulated(4, body) == [((0, 0, 1, 1), "torchrun")] * 4


def test_init_takes_ranks_per_node_and_names_a_bad_one() -> None:
    code = (
        "import os, zero_comm\n"
        "os.environ.pop('ZERO_RANKS_PER_NODE', None)\n"
        "try:\n"
        "    zero_comm.init('gloo', ranks_per_node=2)\n"
        "except ValueError as exc:\n"
        "    assert 'use one of [1]' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no error for ranks_per_node=2 on one rank')\n"
        "comm = zero_comm.init('gloo')\n"
        "assert (comm.topology.node_of, comm.topology.source) == ((0,), 'single-node')\n"
        "comm.close()\n"
        "comm = zero_comm.init('gloo', ranks_per_node=1)\n"
        "assert comm.topology.source == 'argument', comm.topology\n"
        "comm.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------- set_topology


def test_default_override_and_its_errors() -> None:
    def body(comm: Communicator) -> list[object]:
        seen: list[object] = [comm.topology.node_of, comm.topology.source]
        comm.set_topology(2)
        seen += [comm.topology.node_of, comm.topology.source]
        comm.set_topology(Topology((0, 0, 0, 1), "hostname"))
        seen += [comm.topology.node_of, comm.topology.source]
        with pytest.raises(ValueError, match=r"\[rank \d\] set_topology: ranks_per_node=3 does "
                           r"not divide the world size 4; use one of \[1, 2, 4\]"):  # fmt: skip
            comm.set_topology(3)
        with pytest.raises(ValueError, match="has 2 ranks but this communicator 4"):
            comm.set_topology(Topology((0, 1)))
        with pytest.raises(TypeError, match="expected a Topology or a number"):
            comm.set_topology("2")  # type: ignore[arg-type]
        return seen

    assert (
        run_simulated(4, body)
        == [[(0, 0, 0, 0), "single-node", (0, 0, 1, 1), "argument", (0, 0, 0, 1), "hostname"]] * 4
    )


def test_run_simulated_sets_the_world_topology() -> None:
    assert (
        run_simulated(6, lambda c: c.topology.node_of, ranks_per_node=3) == [(0, 0, 0, 1, 1, 1)] * 6
    )
    with pytest.raises(ValueError, match=r"use one of \[1, 2, 4\]"):
        run_simulated(4, lambda c: None, ranks_per_node=3)


# ------------------------------------------------------------- subgroups


class Groups(NamedTuple):
    """Per rank: the world ranks of each subgroup, its nodes, and an all_reduce over it."""

    intra: list[int]
    inter: list[int]
    shard: list[int]
    replica: list[int]
    nodes: list[tuple[int, ...]]
    sums: list[float]


def subgroups(comm: Communicator, shard_size: int) -> Groups:
    intra, inter = comm.intra_node(), comm.inter_node()
    shard, replica = comm.shard_groups(shard_size)
    assert comm.intra_node() is intra and comm.inter_node() is inter  # kept, not remade
    assert comm.shard_groups(shard_size) == (shard, replica)
    groups = (intra, inter, shard, replica)
    sums = []
    for group in groups:
        x = torch.tensor([float(comm.rank)])
        group.all_reduce(x)
        sums.append(x.item())
    intra_r, inter_r, shard_r, replica_r = (list(g.parent_ranks or []) for g in groups)
    nodes = [g.topology.node_of for g in groups]
    return Groups(intra_r, inter_r, shard_r, replica_r, nodes, sums)


@pytest.mark.parametrize(
    ("world_size", "per_node", "shard_size"),
    [(4, 2, 2), (4, 2, 4), (6, 2, 2), (6, 2, 3), (6, 3, 3), (6, 3, 2)],
)
def test_intra_inter_shard_and_replica_groups(
    world_size: int, per_node: int, shard_size: int
) -> None:
    results = run_simulated(world_size, lambda c: subgroups(c, shard_size), ranks_per_node=per_node)
    for rank, got in enumerate(results):
        node, local = rank // per_node, rank % per_node
        intra = list(range(node * per_node, (node + 1) * per_node))
        inter = list(range(local, world_size, per_node))
        block = rank // shard_size
        shard = list(range(block * shard_size, (block + 1) * shard_size))
        replica = list(range(rank % shard_size, world_size, shard_size))
        assert (got.intra, got.inter, got.shard, got.replica) == (intra, inter, shard, replica)
        # Each keeps the world's node numbers for its members.
        assert got.nodes == [
            tuple(r // per_node for r in g) for g in (intra, inter, shard, replica)
        ]
        assert got.sums == [float(sum(g)) for g in (intra, inter, shard, replica)]


def test_shard_groups_name_the_valid_sizes() -> None:
    def body(comm: Communicator) -> None:
        for bad in (4, 0, 7):
            with pytest.raises(ValueError, match=rf"shard_size={bad} does not divide the 6 "
                               r"ranks; valid sizes: \[1, 2, 3, 6\]"):  # fmt: skip
                comm.shard_groups(bad)
        ones, everyone = comm.shard_groups(1)
        assert (ones.world_size, everyone.world_size) == (1, 6)

    run_simulated(6, body)


def test_inter_node_needs_equal_nodes() -> None:
    def body(comm: Communicator) -> None:
        comm.set_topology(Topology((0, 0, 0, 1)))
        assert comm.intra_node().world_size == (3 if comm.rank < 3 else 1)
        comm.inter_node()

    with pytest.raises(SimulatedRankError, match=r"inter_node: the nodes hold unequal numbers "
                       r"of ranks \(\{0: 3, 1: 1\}"):  # fmt: skip
        run_simulated(4, body)


def test_a_new_topology_remakes_the_node_groups_and_splits_keep_world_nodes() -> None:
    def body(comm: Communicator) -> list[object]:
        before = comm.intra_node()
        comm.set_topology(2)
        after = comm.intra_node()
        shard, _ = comm.shard_groups(3)  # {0,1,2} on nodes 0,0,1; {3,4,5} on 1,2,2
        nested = shard.intra_node()
        return [before.world_size, after is before, after.parent_ranks, shard.topology.node_of,
                nested.topology.node_of, nested.world_size]  # fmt: skip

    results = run_simulated(6, body)
    assert results[0] == [6, False, [0, 1], (0, 0, 1), (0, 0), 2]
    assert results[2] == [6, False, [2, 3], (0, 0, 1), (1,), 1]
    assert results[3] == [6, False, [2, 3], (1, 2, 2), (1,), 1]


# ---------------------------------------------------------- stats by link


def test_stats_split_hand_checked_on_two_nodes_of_two() -> None:
    """8 float32 elements on 2 x 2. Ring: ranks 1 and 3 send to the other node (1 -> 2,
    3 -> 0), ranks 0 and 2 within theirs. all_reduce 2*3/4*8 = 12 elements = 48 bytes;
    reduce_scatter and all_gather 6 = 24 bytes; broadcast from 0: 8 = 32 bytes, except on
    rank 3, whose successor is the root (the ring ends there). all_to_all: 2 elements
    (8 bytes) to each other rank, one on this node and two on the other."""

    def body(comm: Communicator) -> dict[str, tuple[Fraction, Fraction]]:
        comm.all_reduce(torch.ones(8))
        comm.reduce_scatter(torch.empty(2), torch.ones(8))
        comm.all_gather(torch.empty(8), torch.ones(2))
        comm.broadcast(torch.ones(8), 0)
        comm.all_to_all(torch.empty(8), torch.ones(8))
        comm.barrier()
        split = {n: (comm.stats[n].intra_node_bytes, comm.stats[n].inter_node_bytes)
                 for n in CommStats.COLLECTIVES}  # fmt: skip
        split["total"] = (comm.stats.intra_node_bytes, comm.stats.inter_node_bytes)
        return split

    results = run_simulated(4, body, ranks_per_node=2)
    f = Fraction
    for rank in range(4):
        crosses = rank in (1, 3)

        def ring(b: int, crosses: bool = crosses) -> tuple[Fraction, Fraction]:
            return (f(0), f(b)) if crosses else (f(b), f(0))

        expected = {
            "all_reduce": ring(48),
            "reduce_scatter": ring(24),
            "all_gather": ring(24),
            "broadcast": ring(0 if rank == 3 else 32),
            "all_to_all": (f(8), f(16)),
            "barrier": (f(0), f(0)),
        }
        ring_bytes = 96 if rank == 3 else 128
        expected["total"] = (f(8), f(16) + ring_bytes) if crosses else (f(8) + 128, f(16))
        assert results[rank] == expected, rank


def test_updating_the_topology_updates_the_rule() -> None:
    stats = CommStats(4, rank=1)
    stats.record("all_gather", 8, 4)
    assert (stats.intra_node_bytes, stats.inter_node_bytes) == (Fraction(24), Fraction(0))
    stats.set_topology(Topology.uniform(4, 2), rank=1)
    stats.record("all_gather", 8, 4)
    assert (stats.intra_node_bytes, stats.inter_node_bytes) == (Fraction(24), Fraction(24))
    row = stats.as_dict()["all_gather"]
    assert (row["intra_node_bytes"], row["inter_node_bytes"], row["volume_bytes"]) == (24, 24, 48)
    with pytest.raises(ValueError, match="do not fit a communicator of 4 ranks"):
        stats.set_topology(Topology.uniform(2, 1), rank=1)


class Call(NamedTuple):
    collective: str
    numel: int
    itemsize: int


calls = st.builds(
    Call,
    st.sampled_from(CommStats.COLLECTIVES),
    st.integers(0, 10**6),
    st.sampled_from([1, 2, 4, 8]),
)


def ring_links_crossing(node_of: tuple[int, ...]) -> int:
    n = len(node_of)
    return sum(node_of[r] != node_of[(r + 1) % n] for r in range(n))


@settings(max_examples=200)
@given(
    node_of=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    made=st.lists(calls, max_size=12),
)
def test_intra_plus_inter_is_the_volume_and_links_add_up(
    node_of: list[int], made: list[Call]
) -> None:
    """For every rank and collective intra + inter == volume, exactly. Summed over ranks,
    a ring collective's inter-node bytes are (ring links crossing nodes) x one rank's
    volume; an all_to_all's are (ordered pairs on different nodes) x B/N per pair."""
    topo = Topology(tuple(node_of))
    n = topo.world_size
    per_rank = [CommStats(n, rank=r, topology=topo) for r in range(n)]
    for stats in per_rank:
        for call in made:
            stats.record(*call)
    links = ring_links_crossing(topo.node_of)
    pairs = sum(not topo.same_node(a, b) for a in range(n) for b in range(n))
    for name in CommStats.COLLECTIVES:
        for stats in per_rank:
            count = stats[name]
            assert count.intra_node_bytes + count.inter_node_bytes == count.volume_bytes
            assert min(count.intra_node_bytes, count.inter_node_bytes) >= 0
        mine = [c for c in made if c.collective == name]
        inter = sum((s[name].inter_node_bytes for s in per_rank), Fraction(0))
        if name == "all_to_all":
            assert inter == sum((Fraction(pairs * c.numel * c.itemsize, n) for c in mine), 0)
        else:
            volume = sum((ring_volume(name, c.numel, n) * c.itemsize for c in mine), Fraction(0))
            assert inter == links * volume
    for stats in per_rank:
        assert stats.intra_node_bytes + stats.inter_node_bytes == stats.total_volume_bytes


@settings(max_examples=15)
@given(
    shape=st.sampled_from([(2, 1), (2, 2), (3, 1), (3, 2), (2, 3)]),
    made=st.lists(st.tuples(st.sampled_from(RING), st.integers(0, 9)), min_size=1, max_size=4),
)
def test_a_communicator_records_the_split_of_its_topology(
    shape: tuple[int, int], made: list[tuple[str, int]]
) -> None:
    """Through real collectives on a simulated world of k nodes: k ring links cross (a
    broadcast from rank 0 uses k - 1 of them: the link into the root carries nothing)."""
    nodes, per_node = shape
    size = nodes * per_node

    def body(comm: Communicator) -> Fraction:
        for name, chunk in made:
            full = torch.ones(chunk * size)
            if name == "all_reduce":
                comm.all_reduce(full)
            elif name == "reduce_scatter":
                comm.reduce_scatter(torch.empty(chunk), full)
            elif name == "all_gather":
                comm.all_gather(full, torch.ones(chunk))
            else:
                comm.broadcast(full, 0)
        return comm.stats.inter_node_bytes

    inter = sum(run_simulated(size, body, ranks_per_node=per_node), Fraction(0))
    crossing = {name: nodes - 1 if name == "broadcast" else nodes for name in RING}
    assert inter == sum(
        (crossing[name] * ring_volume(name, chunk * size, size) * 4 for name, chunk in made),
        Fraction(0),
    )


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
