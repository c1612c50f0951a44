"""ddl-bench's physical floors (--floor): the copy floor above 64 KiB, the shared-memory
ping-pong floor up to it."""

from __future__ import annotations

import mmap
import os
import time
from typing import Optional

import numpy as np

import ddl
from ddl.bench._cases import Case
from ddl.bench._timing import SMALL_CASE_BYTES, Timing, gather_timing
from ddl.core.errors import DDLTimeoutError

# --floor: the copy floor above this size (a smaller copy times a cold call), the
# shared-memory ping-pong floor up to it.
FLOOR_MIN_BYTES = SMALL_CASE_BYTES
PINGPONG_TIMEOUT_S = 30.0  # a whole ping-pong block, warm-up included
_LINE = 64  # bytes: each ping-pong flag on its own cache line


def copy_floor(case: Case, iters: int, warmup: int) -> Timing:
    """The copy floor of ``case``: every rank copies ``case.nbytes`` bytes once with
    ``np.copyto``, all ranks after one barrier per copy; per copy the slowest rank, and
    the median over ``iters`` copies (after ``warmup`` + 1 untimed ones, which also fault
    the pages in). Every rank calls it for the same case."""
    src = np.ones(case.nbytes, np.uint8)
    dst = np.empty_like(src)
    for _ in range(warmup + 1):
        np.copyto(dst, src)
    times = np.empty(iters)
    for i in range(iters):
        ddl.barrier()
        start = time.perf_counter()
        np.copyto(dst, src)
        times[i] = time.perf_counter() - start
    return gather_timing(times, 0, f"{case.name}/stats/floor")


def pingpong_floor(case: Case, iters: int, warmup: int) -> Optional[Timing]:
    """The ping-pong floor of ``case``: ranks 0 and 1 bounce a message of ``case.nbytes``
    bytes through one shared-memory segment (a memfd of rank 0's, which rank 1 opens
    through /proc, so nothing is left behind), each copying it in, raising its flag,
    spinning in Python on the other's flag and copying it out: half the median round trip
    over ``iters`` round trips (after ``warmup`` + 1), the slower of the two ranks. The
    other ranks wait. None on every rank when the job has one rank, its ranks are not
    all on one host, or rank 1 cannot open the segment. Every rank calls it for the same
    case."""
    if ddl.size() < 2 or ddl.local_size() != ddl.size():
        return None
    rank, size = ddl.rank(), 2 * _LINE + 2 * case.nbytes
    fd, failed, segment = -1, 0, None
    if rank == 0:
        fd = os.memfd_create("ddl-bench-pingpong")
        os.ftruncate(fd, size)
    where = np.array([os.getpid(), fd], np.int64)
    where = ddl.broadcast(where, root_rank=0, name="ddl-bench/pingpong/segment")
    try:
        if rank == 1:
            try:
                fd = os.open(f"/proc/{where[0]}/fd/{where[1]}", os.O_RDWR)
            except OSError:
                failed = 1
        if fd >= 0:
            segment = mmap.mmap(fd, size)
        # also keeps rank 0's descriptor open until rank 1 has opened the segment
        failed = int(ddl.allreduce(np.array([failed], np.int64), op=ddl.Sum,
                                   name="ddl-bench/pingpong/opened")[0])
    finally:
        if fd >= 0:
            os.close(fd)  # the mapping keeps the memory
    try:
        if failed:
            return None
        half = _bounce(segment, case.nbytes, rank, iters, warmup) if rank < 2 else 0.0
        return gather_timing(np.array([half]), 0, f"{case.name}/stats/pingpong")
    finally:
        if segment is not None:
            segment.close()


def _bounce(segment: mmap.mmap, nbytes: int, rank: int, iters: int, warmup: int) -> float:
    """Rank 0's or rank 1's side of :func:`pingpong_floor`: half the median round trip in
    seconds. DDLTimeoutError when the other rank does not answer within
    PINGPONG_TIMEOUT_S."""
    flags = np.frombuffer(segment, np.int64, count=2 * _LINE // 8)
    mine, theirs = (0, _LINE // 8) if rank == 0 else (_LINE // 8, 0)
    slot_in, slot_out = (np.frombuffer(segment, np.uint8, nbytes, 2 * _LINE + k * nbytes)
                         for k in ((1, 0) if rank == 0 else (0, 1)))
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    deadline = time.monotonic() + PINGPONG_TIMEOUT_S

    def wait(seq: int) -> None:
        spins = 0
        while flags[theirs] != seq:
            spins += 1
            if spins % 256 == 0:  # let the other rank run if it shares our core
                os.sched_yield()
                if time.monotonic() > deadline:
                    raise DDLTimeoutError(
                        f"ddl-bench --floor: rank {1 - rank} did not answer the ping-pong "
                        f"within {PINGPONG_TIMEOUT_S:g} s", op="ddl-bench",
                        timeout=PINGPONG_TIMEOUT_S, rank=1 - rank, cause="ping-pong")

    def round_trip(seq: int) -> None:
        if rank == 0:
            np.copyto(slot_out, src)
            flags[mine] = seq
            wait(seq)
            np.copyto(dst, slot_in)
        else:
            wait(seq)
            np.copyto(dst, slot_in)
            np.copyto(slot_out, src)
            flags[mine] = seq

    for seq in range(1, warmup + 2):
        round_trip(seq)
    times = np.empty(iters)
    for i, seq in enumerate(range(warmup + 2, warmup + 2 + iters)):
        start = time.perf_counter()
        round_trip(seq)
        times[i] = time.perf_counter() - start
    return float(np.median(times)) / 2
