"""Micro-benchmark of the TCP data plane: 2+ real processes on loopback.

    python examples/bench_tcp_ring.py [--np 2] [--iters 20]

Reports the median time of ring allreduce (float32, 16 MiB) and recursive-doubling
allreduce (float32, 4 bytes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from ddl.core.dtypes import ReduceOp
from ddl.dataplane.algorithms import allreduce
from ddl.dataplane.transports.base import Group
from ddl.dataplane.transports.tcp import TcpTransport

CASES = [("ring", 16 << 20, 10), ("recursive_doubling", 4, 1000)]


def worker(rank, size, secret, job_id, addr_q, peers_q, result_q, iters):
    t = TcpTransport(rank, size, secret, job_id)
    addr_q.put((rank, t.listen()))
    t.set_peers(peers_q.get())
    group = Group.of(range(size), rank)
    t.connect_all(range(size), time.monotonic() + 30)
    results = {}
    for algorithm, nbytes, reps in CASES:
        buf = np.zeros(nbytes // 4, dtype=np.float32)  # stays finite under repeated Sum
        times = []
        for _ in range(max(3, reps * iters // 10) + 3):
            start = time.perf_counter()
            allreduce(buf, ReduceOp.Sum, group, t, time.monotonic() + 60, algorithm=algorithm)
            times.append(time.perf_counter() - start)
        results[algorithm] = statistics.median(times[3:]) * 1e3
        buf[...] = rank + 1
        allreduce(buf, ReduceOp.Sum, group, t, time.monotonic() + 60, algorithm=algorithm)
        if not (buf == size * (size + 1) / 2).all():
            raise SystemExit(f"rank {rank}: wrong {algorithm} result {buf[:4]}")
    result_q.put((rank, results))
    t.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    addr_q, result_q = ctx.Queue(), ctx.Queue()
    peers_qs = [ctx.Queue() for _ in range(args.np)]
    secret, job_id = os.urandom(32), os.urandom(8).hex()
    procs = [ctx.Process(target=worker, args=(r, args.np, secret, job_id, addr_q, peers_qs[r],
                                              result_q, args.iters)) for r in range(args.np)]
    for p in procs:
        p.start()
    peers = dict(addr_q.get(timeout=60) for _ in procs)
    for q in peers_qs:
        q.put(peers)
    results = dict(result_q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for algorithm, nbytes, _ in CASES:
        ms = max(r[algorithm] for r in results.values())
        extra = f", {nbytes / (ms / 1e3) / 2**30:.2f} GiB/s algbw" if nbytes > 4096 else ""
        print(f"{algorithm:>20} float32 {nbytes:>9} B, {args.np} procs: median "
              f"{ms:.3f} ms{extra}")


if __name__ == "__main__":
    main()
