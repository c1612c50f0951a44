"""Checks of the response cache, run inside every rank of a world (see test_cache.py)."""

from __future__ import annotations

import numpy as np

import ddl
from ddl import _runtime


def _cache():
    engine = _runtime.runtime().engine
    return engine.cache, engine.cycles


def check_cache() -> list:
    """Steady state, fusion, broadcast, changed arguments, async order, join."""
    out = []
    r, n = ddl.rank(), ddl.size()
    cache, cycles = _cache()
    if cache is None:
        return [f"rank {r}: the response cache is not running"]

    def expect(got, want, what):
        if not (np.asarray(got).dtype == np.asarray(want).dtype and np.array_equal(got, want)):
            out.append(f"rank {r}: {what}: got {got!r}, expected {want!r}")

    total = n * (n - 1) // 2
    # the same names, step after step: the first step goes through the leader
    for step in range(30):
        x = np.arange(5, dtype=np.float32) + r + step
        expect(ddl.allreduce(x, name="grad/w", op=ddl.Sum),
               (np.arange(5) * n + total + n * step).astype(np.float32), f"step {step}")
        b = ddl.broadcast(np.full(3, r + step, np.int64), root_rank=n - 1, name="bcast")
        expect(b, np.full(3, n - 1 + step, np.int64), f"broadcast step {step}")
    if len(cache.live_slots()) < 2:
        out.append(f"rank {r}: expected cached slots, have {cache.live_slots()}")
    # several cached names at once, waited out of order: fused in one cycle
    for step in range(5):
        hs = [ddl.allreduce_async(np.full(4, r * 10 + k, np.float64), name=f"layer{k}",
                                  op=ddl.Sum) for k in range(6)]
        for k in reversed(range(6)):
            expect(hs[k].wait(), np.full(4, total * 10 + n * k, np.float64),
                   f"fused layer{k} step {step}")
    # Average and scale factors through the cache
    for step in range(3):
        got = ddl.allreduce(np.full(2, float(r), np.float32), name="avg",
                            postscale_factor=2.0)
        expect(got, np.full(2, 2.0 * total / n, np.float32), "average")
    # every rank changes the shape: the old slot is dropped, the new call goes through
    for step in range(3):
        got = ddl.allreduce(np.ones((2, 3), np.float32), name="grad/w", op=ddl.Sum)
        expect(got, np.full((2, 3), n, np.float32), f"new shape step {step}")
    # one rank changes the dtype: MismatchError on every rank, and the job goes on
    try:
        dt = np.float64 if r == 0 else np.float32
        ddl.allreduce(np.ones((2, 3), dt), name="grad/w", op=ddl.Sum)
        out.append(f"rank {r}: a dtype mismatch through the cache did not raise")
    except ddl.MismatchError as exc:
        if "dtype mismatch" not in str(exc) or "grad/w" not in str(exc):
            out.append(f"rank {r}: unexpected mismatch text: {exc}")
    expect(ddl.allreduce(np.ones(2, np.float32), name="after", op=ddl.Sum),
           np.full(2, n, np.float32), "after the mismatch")
    # unnamed calls in the same order on every rank are fine too
    for _ in range(3):
        expect(ddl.allreduce(np.ones(1, np.int32), op=ddl.Sum), np.full(1, n, np.int32),
               "unnamed")
    return out


def check_join_with_cache() -> list:
    """A rank that joins early while the others keep using cached names."""
    out = []
    r, n = ddl.rank(), ddl.size()
    for step in range(5):
        ddl.allreduce(np.ones(3, np.float32), name="j/grad", op=ddl.Sum)
    if r == 0:
        last = ddl.join()
    else:
        for step in range(4):
            got = ddl.allreduce(np.ones(3, np.float32), name="j/grad", op=ddl.Sum)
            if not np.array_equal(got, np.full(3, n - 1, np.float32)):
                out.append(f"rank {r}: with rank 0 joined, step {step}: {got}")
        last = ddl.join()
    if last not in range(1, n):
        out.append(f"rank {r}: join returned {last}")
    # after everyone joined, the job goes on and the cache works again
    for step in range(5):
        got = ddl.allreduce(np.ones(3, np.float32), name="j/grad2", op=ddl.Sum)
        if not np.array_equal(got, np.full(3, n, np.float32)):
            out.append(f"rank {r}: after join, step {step}: {got}")
    return out
