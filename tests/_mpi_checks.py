"""One MPI world (``mpiexec -n 4 python tests/_mpi_checks.py``) that checks ddl's MPI
starts in turn: plain ``init()``, MPI and ddl mixed (also from two threads), process sets
of communicators, the halves of ``COMM_WORLD.Split`` as concurrent jobs, ``init(comm=[2, 0])``, bad ``comm`` values,
and a rank that never calls init. Rank 0 prints ``MPI CHECKS OK`` or every failure."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import ddl

world = MPI.COMM_WORLD
failures = []


def check(cond, what):
    if not cond:
        failures.append(f"COMM_WORLD rank {world.rank}: {what}")


def plain_init():
    ddl.init()
    r, n = ddl.rank(), ddl.size()
    check((r, n) == (world.rank, world.size), f"rank/size {(r, n)}")
    check(ddl.local_rank() == int(os.environ["MPI_LOCALRANKID"]), "local rank")
    check(ddl.local_size() == int(os.environ["MPI_LOCALNRANKS"]), "local size")
    check(ddl.mpi_enabled() and ddl.mpi_built() and ddl.mpi_threads_supported(), "queries")
    big = np.arange(1 << 20, dtype=np.float32) + r
    want = np.arange(1 << 20, dtype=np.float32) * n + n * (n - 1) / 2
    check(np.array_equal(ddl.allreduce(big, op=ddl.Sum, name="big"), want), "allreduce")
    rows = ddl.allgather(np.full((r + 1, 2), r, np.int32), name="rows")
    check(rows.shape == (n * (n + 1) // 2, 2) and rows[-1, 0] == n - 1, "allgather")
    check(int(ddl.broadcast(np.array([r]), root_rank=n - 1, name="b")[0]) == n - 1,
          "broadcast")
    got, splits = ddl.alltoall(np.arange(n, dtype=np.int64) + 10 * r, name="a2a")
    check(got.tolist() == [10 * k + r for k in range(n)], f"alltoall {got}")
    part = ddl.reducescatter(np.ones((2 * n, 3), np.float32), op=ddl.Sum, name="rs")
    check(part.shape == (2, 3) and np.all(part == n), "reducescatter")
    # MPI and ddl calls interleaved, sizes from 1 element to 4 MiB
    for i, count in enumerate([1, 100, 4096, 1 << 18, 1 << 20, 7]):
        x = np.full(count, float(r + i), np.float32)
        y = np.empty_like(x)
        world.Allreduce(x, y, op=MPI.SUM)
        z = ddl.allreduce(x, op=ddl.Sum, name=f"mix{i}")
        check(np.array_equal(y, z) and y[0] == n * i + n * (n - 1) / 2, f"mixed {i}")
    # and at the same time from two threads: MPI on a duplicate, ddl on the main thread
    dup = world.Dup()
    mpi_ok = []

    def mpi_loop():
        for i in range(50):
            mpi_ok.append(dup.allreduce(i + r) == n * i + n * (n - 1) // 2)
    t = threading.Thread(target=mpi_loop)
    t.start()
    for i in range(50):
        check(float(ddl.allreduce(np.array([1.0]), op=ddl.Sum, name="th")[0]) == n,
              "ddl beside an MPI thread")
    t.join(60)
    check(not t.is_alive() and len(mpi_ok) == 50 and all(mpi_ok), "MPI thread")
    dup.Free()
    ddl.shutdown()
    check(not ddl.is_initialized(), "shutdown")


def split_halves():
    sub = world.Split(color=world.rank % 2, key=world.rank)
    ddl.init(comm=sub)
    mine = [k for k in range(world.size) if k % 2 == world.rank % 2]
    check((ddl.rank(), ddl.size()) == (mine.index(world.rank), len(mine)),
          f"half: ddl rank {ddl.rank()} size {ddl.size()}")
    for i in range(30):  # the same names in both jobs, at the same time
        got = ddl.allreduce(np.array([float(world.rank), i]), op=ddl.Sum, name="same")
        check(got.tolist() == [sum(mine), i * len(mine)], f"half sum {got}")
    ddl.shutdown()
    sub.Free()


def comm_process_sets():
    """Horovod's process sets of mpi4py communicators: each rank passes its own half of a
    Split (and clones of it and of COMM_WORLD) to init(process_sets=...); every half is
    registered on every rank, in rank order, and a clone is the same set; in the job of
    one half, a communicator holding processes outside it is refused, naming them."""
    n = world.size
    sub = world.Split(color=world.rank % 2, key=world.rank)
    whole, half = world.Dup(), sub.Dup()
    mine = ddl.ProcessSet(sub)
    ddl.init(comm=world, process_sets=[mine, ddl.ProcessSet(range(0, n, 2)),
                                       ddl.ProcessSet(whole), ddl.ProcessSet(half),
                                       ddl.ProcessSet([0])])
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    known = ddl.get_process_set_ids_and_ranks()
    check(known == {0: list(range(n)), 1: evens, 2: odds, 3: [0]}, f"sets {known}")
    ids = [ddl.comm_process_set_id(c) for c in (sub, half, whole)]
    check(ids == [1 + world.rank % 2] * 2 + [0] and mine.process_set_id == ids[0]
          and mine.mpi_comm is sub, f"comm_process_set_id {ids}, {mine}")
    check(mine.ranks == (evens if world.rank % 2 == 0 else odds)   # lists, as Horovod's
          and ddl.global_process_set.ranks == list(range(n))
          and ddl.global_process_set.mpi_comm is world,
          f"ranks {mine.ranks}, global {ddl.global_process_set.ranks} "
          f"{ddl.global_process_set.mpi_comm}")
    got = ddl.allreduce(np.array([world.rank]), op=ddl.Sum, name="half", process_set=mine)
    check(int(got[0]) == sum(evens if world.rank % 2 == 0 else odds), f"half sum {got}")
    ddl.shutdown()
    ddl.init(comm=sub)
    try:
        ddl.add_process_set(ddl.ProcessSet(world))
        check(False, "a set of COMM_WORLD in a job of half of it was taken")
    except ValueError as exc:
        check("ranks [1, 3] are not in this ddl job" in str(exc)
              or "ranks [0, 2] are not in this ddl job" in str(exc), f"outside: {exc}")
    check(ddl.comm_process_set_id(half) == 0, "the half's own communicator is its global set")
    ddl.shutdown()
    for c in (sub, whole, half):
        c.Free()


def rank_list():
    if world.rank in (0, 2):
        ddl.init(comm=[2, 0])
        check((ddl.rank(), ddl.size()) == ([2, 0].index(world.rank), 2),
              f"list: ddl rank {ddl.rank()}")
        got = ddl.allgather(np.array([world.rank]), name="who")
        check(got.tolist() == [2, 0], f"list allgather {got}")
        ddl.shutdown()
    else:  # left out: no init here; bad comm values fail at once, naming what was wrong
        for bad, text in (([0, 2], "leaves out"), ([world.rank, world.rank], "distinct"),
                          ([world.rank, 99], "distinct"), ("x", "not str")):
            try:
                ddl.init(comm=bad)
                check(False, f"init(comm={bad!r}) did not raise")
            except ddl.ConfigError as exc:
                check(text in str(exc) and exc.variable == "comm", f"{bad!r}: {exc}")
    world.Barrier()


def missing_rank():
    """Rank 3 never calls init: the others raise DDLTimeoutError after DDL_START_TIMEOUT."""
    comm = world.Dup()  # left with a pending barrier: not used again
    if world.rank != 3:
        os.environ["DDL_START_TIMEOUT"] = "2"
        t0 = time.monotonic()
        try:
            ddl.init(comm=comm)
            check(False, "init without rank 3 did not raise")
        except ddl.DDLTimeoutError as exc:
            took = time.monotonic() - t0
            check(1.5 < took < 10 and "DDL_START_TIMEOUT" in str(exc), f"{took:.1f} s: {exc}")
        finally:
            del os.environ["DDL_START_TIMEOUT"]
        check(not ddl.is_initialized(), "initialized after a failed init")
    world.Barrier()


def main() -> int:
    for phase in (plain_init, comm_process_sets, split_halves, rank_list, missing_rank):
        try:
            phase()
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"COMM_WORLD rank {world.rank}: {phase.__name__} raised "
                            f"{type(exc).__name__}: {exc}")
            break
    every = world.gather(failures, root=0)
    if world.rank == 0:
        flat = [f for per_rank in every for f in per_rank]
        print("\n".join(flat) if flat else "MPI CHECKS OK", flush=True)
        return 1 if flat else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
