"""ddl inside an MPI program: each half of COMM_WORLD is its own ddl job.

Run it with:  mpiexec -n 4 python examples/mpi4py_subcomm.py
(or:          ddlrun --mpi -np 4 python examples/mpi4py_subcomm.py)

The even and the odd COMM_WORLD ranks each form a sub-communicator and call
``ddl.init(comm=subcomm)``: two independent ddl jobs run side by side. One allreduce per
job sums the COMM_WORLD ranks of its members, so the right answer depends on the half a
rank is in; an MPI allreduce over COMM_WORLD in between shows that MPI and ddl mix.
"""

import sys

import numpy as np
from mpi4py import MPI

import ddl


def main() -> int:
    world = MPI.COMM_WORLD
    subcomm = world.Split(color=world.rank % 2, key=world.rank)
    ddl.init(comm=subcomm)
    print("COMM_WORLD rank: %d, ddl rank: %d" % (world.rank, ddl.rank()), flush=True)

    mine = [r for r in range(world.size) if r % 2 == world.rank % 2]
    total = ddl.allreduce(np.array([float(world.rank)]), op=ddl.Sum, name="world_ranks")
    everyone = world.allreduce(world.rank)  # plain MPI, between two ddl calls
    again = ddl.allreduce(np.array([1.0]), op=ddl.Sum, name="members")
    ok = (float(total[0]) == sum(mine) and everyone == sum(range(world.size))
          and ddl.size() == len(mine) and ddl.rank() == mine.index(world.rank)
          and float(again[0]) == len(mine))
    print(f"COMM_WORLD rank {world.rank}: half {world.rank % 2} of ranks {mine}, ddl sum "
          f"{float(total[0]):g}, MPI sum {everyone} -> {'OK' if ok else 'WRONG'}", flush=True)
    ddl.shutdown()
    subcomm.Free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
