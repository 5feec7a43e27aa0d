"""Check this machine's backend against the collective properties, on real ranks.

    zero-launch -n 3 python -m zero_comm.testing.selfcheck --backend gloo
    mpiexec -n 4 python -m mpi4py -m zero_comm.testing.selfcheck --backend mpi

Runs the hypothesis suite of :mod:`zero_comm.testing.properties` with a deterministic
communicator (bit-exact expectations) and then a native one (rounding tolerances).
"""

from __future__ import annotations

import argparse

import zero_comm
from zero_comm.testing.properties import check_mismatch_is_named, run_collective_properties


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--examples", type=int, default=100)
    args = parser.parse_args()
    for deterministic in (True, False):
        comm = zero_comm.init(args.backend, deterministic=deterministic, timeout=60)
        ran = run_collective_properties(comm, args.examples)
        check_mismatch_is_named(comm)
        if comm.rank == 0:
            kind = "deterministic" if deterministic else "native"
            print(f"{comm.backend} x{comm.world_size} {kind}: {ran} examples passed")
        if deterministic:
            comm.barrier()
    comm.close()


if __name__ == "__main__":
    main()
