"""Allreduce latency and bandwidth, ddl next to torch.distributed Gloo, in the same run.

    ddlrun -np 2 python examples/bench_allreduce.py [--sizes 4,1048576,16777216] [--iters 20]

Prints an nccl-tests-style table from rank 0: size, time (median), algbw, busbw, and
Gloo's time on the same buffers when torch is installed (pip install torch). Both are
run interleaved, size by size, in the same processes. busbw = algbw * 2 (n - 1) / n.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np

import ddl


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _init_gloo():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    port = 0
    if ddl.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = int(ddl.broadcast(np.array([port]), root_rank=0, name="bench/port")[0])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=ddl.rank(), world_size=ddl.size())
    return torch, dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,1024,65536,1048576,16777216",
                        help="comma-separated message sizes in bytes")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    ddl.init()
    n = ddl.size()
    gloo = _init_gloo()
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(1, nbytes // 4)
        x = np.random.default_rng(ddl.rank()).standard_normal(count).astype(np.float32)
        name = f"bench/{nbytes}"
        ddl_ms = _median_ms(lambda: ddl.allreduce(x, name=name, op=ddl.Sum), args.iters)
        gloo_ms = float("nan")
        if gloo is not None:
            torch, dist = gloo
            t = torch.from_numpy(x.copy())
            gloo_ms = _median_ms(lambda: dist.all_reduce(t), args.iters)
        rows.append((count * 4, count, ddl_ms, gloo_ms))

    if ddl.rank() == 0:
        print(f"# allreduce float32 Sum, {n} ranks, median of {args.iters}")
        print(f"{'size(B)':>10} {'count':>10} {'time(ms)':>10} {'algbw(GB/s)':>12} "
              f"{'busbw(GB/s)':>12} {'gloo(ms)':>10} {'gloo/ddl':>9}")
        for nbytes, count, ms, gms in rows:
            algbw = nbytes / (ms * 1e-3) / 1e9
            busbw = algbw * 2 * (n - 1) / n
            ratio = gms / ms if gms == gms else float("nan")
            print(f"{nbytes:>10} {count:>10} {ms:>10.3f} {algbw:>12.3f} {busbw:>12.3f} "
                  f"{gms:>10.3f} {ratio:>9.2f}")
    if gloo is not None:
        gloo[1].destroy_process_group()
    ddl.shutdown()


if __name__ == "__main__":
    main()
