"""Shared-memory allreduce next to torch.distributed Gloo, in the same processes.

    python examples/bench_shm.py [--np 2,4] [--sizes 4,65536,1048576] [--iters 30]

Starts ``N`` processes itself (multiprocessing, spawn), one host, no ddlrun: each joins a
:class:`ddl.dataplane.transports.shm.ShmGroup` and, when torch is installed, a Gloo process group
(``tcp://127.0.0.1``). For each size it times float32 Sum allreduces in place, first over
shared memory, then over Gloo, median of ``--iters`` calls after warm-up calls; the two
alternate ``--repeat`` times and each keeps its best median (robust to a busy machine).
Rank 0 prints an nccl-tests-style table. busbw = algbw * 2 (N - 1) / N.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import socket
import statistics
import sys
import time

import numpy as np


def _median_us(fn, iters: int, barrier) -> float:
    for _ in range(max(5, iters // 5)):
        fn()
    barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _rank_main(rank, n, job_id, secret, port, args, results) -> None:
    from ddl.core.dtypes import ReduceOp
    from ddl.dataplane.algorithms import shm_collectives as shm
    from ddl.dataplane.transports.shm import ShmGroup

    kwargs = {"slot_bytes": args.slot_bytes} if args.slot_bytes else {}
    group = ShmGroup(job_id, secret, socket.gethostname(), rank, n, **kwargs)
    group.connect(time.monotonic() + 60)
    dist = None
    if not args.no_gloo:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            dist = None
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=n)
    rows = []
    np.seterr(over="ignore", invalid="ignore")   # repeated in-place sums overflow to inf
    for nbytes in args.sizes:
        count = max(1, nbytes // 4)
        x = np.random.default_rng(rank).standard_normal(count).astype(np.float32)

        def barrier():
            shm.barrier(group, time.monotonic() + 60)

        shm_us = gloo_us = float("inf")
        if dist is not None:
            t = torch.from_numpy(np.random.default_rng(rank).standard_normal(count)
                                 .astype(np.float32))
        for _ in range(args.repeat):   # alternate, keep each one's best median
            shm_us = min(shm_us, _median_us(
                lambda: shm.allreduce(x, ReduceOp.Sum, group, time.monotonic() + 60,
                                      small_bytes=args.small_bytes,
                                      algorithm=args.algorithm), args.iters, barrier))
            if dist is not None:
                gloo_us = min(gloo_us, _median_us(lambda: dist.all_reduce(t), args.iters,
                                                  dist.barrier))
        rows.append((count * 4, count, shm_us, gloo_us if dist is not None else float("nan")))
    if dist is not None:
        dist.destroy_process_group()
    group.close()
    if rank == 0:
        results.put(rows)


def _table(n: int, rows, iters: int, repeat: int) -> str:
    lines = [f"# allreduce float32 Sum, {n} ranks on {os.cpu_count()} CPUs, best of {repeat} "
             f"medians of {iters} calls",
             f"{'size(B)':>10} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'gloo(us)':>10} {'gloo/shm':>9}"]
    for nbytes, count, us, gus in rows:
        algbw = nbytes / (us * 1e-6) / 1e9
        busbw = algbw * 2 * (n - 1) / n
        lines.append(f"{nbytes:>10} {count:>10} {us:>10.1f} {algbw:>12.3f} {busbw:>12.3f} "
                     f"{gus:>10.1f} {gus / us:>9.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", default="2,4", help="comma-separated numbers of processes")
    parser.add_argument("--sizes", default="4,65536,1048576,16777216,67108864",
                        help="comma-separated message sizes in bytes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3,
                        help="timing runs per size and library (alternating); best median")
    parser.add_argument("--slot-bytes", type=int, default=0,
                        help="ShmGroup slot_bytes (default: the library's)")
    parser.add_argument("--small-bytes", type=int, default=None,
                        help="allreduce small_bytes (default: the library's)")
    from ddl.dataplane.algorithms.shm_collectives import ALLREDUCE_ALGORITHMS
    parser.add_argument("--algorithm", choices=ALLREDUCE_ALGORITHMS, default="auto",
                        help="force the allreduce algorithm (default: auto)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the Gloo column")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    ctx = multiprocessing.get_context("spawn")
    for n in (int(s) for s in args.np.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = ctx.Queue()
        job_id, secret = secrets.token_hex(8), os.urandom(32)
        procs = [ctx.Process(target=_rank_main, args=(r, n, job_id, secret, port, args, results))
                 for r in range(n)]
        for p in procs:
            p.start()
        rows = results.get(timeout=1800)
        for p in procs:
            p.join()
            if p.exitcode:
                sys.exit(f"rank exited with code {p.exitcode}")
        print(_table(n, rows, args.iters, args.repeat), flush=True)


if __name__ == "__main__":
    main()
