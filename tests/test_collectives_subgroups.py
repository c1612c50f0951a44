"""Disjoint process sets share one set of transports and run at the same time."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_tcp_world import close_world, make_world, run_threads

from ddl.core.dtypes import ReduceOp
from ddl.dataplane.algorithms import allgatherv, allreduce, broadcast
from ddl.dataplane.transports.base import Group


@pytest.mark.timeout(60)
def test_concurrent_disjoint_groups():
    world = make_world(5, poll_interval=0.05)
    sets = {r: ((1, 3) if r in (1, 3) else (0, 2, 4)) for r in range(5)}
    lengths = [1, 7, 50_000, 300_000]

    def value(r, length, it):
        return np.random.default_rng(r * 1000 + length + it).uniform(-1, 1, length)

    def fn(r):
        g = Group.of(sets[r], r)
        out = []
        for it in range(3):
            for length in lengths:
                for algorithm in ("ring", "recursive_doubling"):
                    x = value(r, length, it).astype(np.float64)
                    allreduce(x, ReduceOp.Sum, g, world[r], time.monotonic() + 20,
                              algorithm=algorithm, chunk_bytes=8192)
                    out.append(x)
            b = np.full(1000, r, dtype=np.uint8)
            broadcast(b, 1, g, world[r], time.monotonic() + 20)
            out.append(b)
            gathered = np.empty(len(g.ranks), dtype=np.uint8)
            allgatherv(bytes([r]), gathered, [1] * g.size, g, world[r], time.monotonic() + 20)
            out.append(gathered)
        return out

    try:
        results = run_threads(5, fn, timeout=50)
        connected = {r: set(world[r]._conns) for r in range(5)}
    finally:
        close_world(world)
    for r in range(5):
        members = sets[r]
        k = 0
        for it in range(3):
            for length in lengths:
                expected = sum(value(m, length, it) for m in members)
                for _ in range(2):
                    np.testing.assert_allclose(results[r][k], expected, rtol=1e-12, atol=1e-12)
                    assert results[r][k].tobytes() == results[members[0]][k].tobytes()
                    k += 1
            assert (results[r][k] == members[1]).all()
            assert results[r][k + 1].tolist() == list(members)
            k += 2
    # Members of one set only ever connected to each other.
    for r in range(5):
        assert connected[r] == set(sets[r]) - {r}
