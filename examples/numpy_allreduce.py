"""The smallest ddl program: every rank contributes its rank, and checks what comes back.

Run it with:  ddlrun -np 4 python examples/numpy_allreduce.py
or alone:     python examples/numpy_allreduce.py   (a job of size 1)
"""

import sys

import numpy as np

import ddl


def main() -> int:
    ddl.init()
    rank, size = ddl.rank(), ddl.size()
    x = np.full(4, float(rank), dtype=np.float32)

    total = ddl.allreduce(x, name="example/sum", op=ddl.Sum)
    mean = ddl.allreduce(x, name="example/mean")  # Average is the default
    rows = ddl.allgather(np.full((rank + 1, 2), rank, dtype=np.int64), name="example/rows")
    seed = ddl.broadcast(np.array([1234 + rank]), root_rank=0, name="example/seed")

    expected_sum = size * (size - 1) / 2
    ok = (np.all(total == expected_sum)
          and np.allclose(mean, expected_sum / size)
          and rows.shape == (size * (size + 1) // 2, 2)
          and int(seed[0]) == 1234
          and np.all(x == rank))  # the input is never modified
    print(f"rank {rank}/{size} (local {ddl.local_rank()}/{ddl.local_size()}): "
          f"sum={total.tolist()} mean={mean.tolist()} gathered_rows={rows.shape[0]} "
          f"seed={int(seed[0])} -> {'OK' if ok else 'WRONG'}")
    ddl.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
