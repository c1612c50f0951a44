"""CuPy arrays through ddl: every collective on the GPU, and a data-parallel training loop
whose gradients never leave the device.

Run it with:  ddlrun -np 2 python examples/cupy_allreduce.py        (needs CuPy and a GPU)

Each rank takes GPU ``local_rank % device_count`` (ranks may share one GPU: within a host
the bytes move over CUDA IPC). A collective takes a CuPy array and returns a new CuPy
array on the same device, ordered on the current CUDA stream: work queued after it on that
stream sees the result, with no device-wide synchronisation. The script checks every
result against what it must be and exits non-zero on a wrong one.
"""

import argparse
import sys

import cupy as cp
import numpy as np

import ddl


def collectives(rank: int, size: int) -> list:
    """Every collective on CuPy arrays; the names of those that came back wrong."""
    wrong = []

    def check(what: str, got, want, exact: bool = True) -> None:
        on_device = isinstance(got, cp.ndarray) and got.device == cp.cuda.Device()
        same = np.array_equal if exact else np.allclose
        if not on_device or got.dtype != want.dtype or not same(cp.asnumpy(got), want):
            wrong.append(what)

    x = cp.arange(6, dtype=cp.float32) + rank
    every = [np.arange(6, dtype=np.float32) + r for r in range(size)]
    check("allreduce", ddl.allreduce(x, name="cupy/sum", op=ddl.Sum), sum(every))
    check("allreduce average", ddl.allreduce(x, name="cupy/mean"), sum(every) / size,
          exact=False)
    check("allreduce max", ddl.allreduce(x, name="cupy/max", op=ddl.Max), every[-1])
    rows = cp.full((rank + 1, 2), rank, dtype=cp.int64)   # dim 0 differs per rank
    check("allgather", ddl.allgather(rows, name="cupy/rows"),
          np.concatenate([np.full((r + 1, 2), r) for r in range(size)]))
    check("broadcast", ddl.broadcast(x, root_rank=size - 1, name="cupy/bcast"), every[-1])
    parts = cp.ones((2 * size, 3), dtype=cp.float16) * (rank + 1)
    check("reducescatter", ddl.reducescatter(parts, name="cupy/rs", op=ddl.Sum),
          np.full((2, 3), size * (size + 1) / 2, np.float16))
    got, splits = ddl.alltoall(cp.arange(size, dtype=cp.int32) + 10 * rank,
                               splits=[1] * size, name="cupy/a2a")
    check("alltoall", got, np.array([10 * r + rank for r in range(size)], np.int32))
    grouped = ddl.grouped_allreduce([x, 2 * x], name="cupy/group", op=ddl.Sum)
    check("grouped allreduce", grouped[1], 2 * sum(every))
    # on a stream of our own: the collective is ordered on it, and so is what reads it
    with cp.cuda.Stream(non_blocking=True):
        y = x * 3                                    # queued on this stream
        z = ddl.allreduce(y, name="cupy/stream", op=ddl.Sum) + 1
        check("allreduce on a side stream", z, 3 * sum(every) + 1)
    if not np.array_equal(cp.asnumpy(x), every[rank]):
        wrong.append("the input was modified")
    return wrong


def train(rank: int, size: int, steps: int) -> float:
    """Linear regression, each rank on its own shard of the data, gradients averaged on
    the device; returns the largest error of the learnt weights."""
    true_w = cp.asarray([2.0, -3.0, 0.5], dtype=cp.float32)
    shard = np.random.default_rng(seed=rank).standard_normal((256, 3))  # its own data
    features = cp.asarray(shard, dtype=cp.float32)   # loaded on the host, moved once
    labels = features @ true_w
    w = ddl.broadcast(cp.zeros(3, dtype=cp.float32), root_rank=0, name="train/init")
    lr = 0.1
    for _ in range(steps):
        grad = 2 * features.T @ (features @ w - labels) / len(features)
        w = w - lr * ddl.allreduce(grad, name="train/grad")   # Average over the ranks
    return float(cp.abs(w - true_w).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    args = parser.parse_args()
    ddl.init()
    rank, size = ddl.rank(), ddl.size()
    cp.cuda.Device(ddl.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
    wrong = collectives(rank, size)
    error = train(rank, size, args.steps)
    ok = not wrong and error < 1e-3
    print(f"rank {rank}/{size} on GPU {cp.cuda.Device().id}: collectives "
          f"{'OK' if not wrong else 'WRONG: ' + ', '.join(wrong)}; trained to within "
          f"{error:.1e} of the true weights -> {'OK' if ok else 'WRONG'}", flush=True)
    ddl.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
