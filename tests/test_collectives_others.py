"""allgatherv, broadcast, alltoallv and reducescatter over real loopback sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_tcp_world import close_world, make_world, run_threads

from ddl.core.dtypes import BFLOAT16, ReduceOp
from ddl.dataplane.algorithms import allgatherv, alltoallv, broadcast, reducescatter
from ddl.dataplane.transports.base import Group

CHUNK = 4096


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def world(request):
    n = request.param
    w = make_world(n, poll_interval=0.05) if n > 1 else [None]
    yield n, w
    close_world([t for t in w if t is not None])


def payload(rank, nbytes, salt=0):
    return np.random.default_rng(1000 * salt + rank).integers(0, 256, nbytes, dtype=np.uint8)


def count_sets(n):
    return [[0] * n, [1] * n, [(3 * k + 1) % 5 for k in range(n)],
            [10_007 if k % 2 else 0 for k in range(n)], [4099 + k for k in range(n)]]


@pytest.mark.timeout(60)
def test_allgatherv(world):
    n, w = world
    sets = count_sets(n)

    def fn(r):
        g = Group.of(range(n), r)
        outs = []
        for s, counts in enumerate(sets):
            out = np.empty(sum(counts), dtype=np.uint8)
            allgatherv(memoryview(payload(r, counts[r], s)), out, counts, g, w[r],
                       time.monotonic() + 20)
            outs.append(out)
        return outs

    results = run_threads(n, fn)
    for s, counts in enumerate(sets):
        expected = np.concatenate([payload(k, counts[k], s) for k in range(n)])
        for r in range(n):
            np.testing.assert_array_equal(results[r][s], expected, err_msg=f"{counts} rank {r}")


@pytest.mark.timeout(60)
def test_broadcast_every_root_tree_and_chain(world):
    n, w = world
    sizes = [0, 1, n + 1, 10_007, 5 * CHUNK + 3]  # the last two take the chain for n > 2

    def fn(r):
        g = Group.of(range(n), r)
        outs = []
        for root in range(n):
            for size in sizes:
                buf = payload(r, size, 100 * root + size)
                broadcast(buf, root, g, w[r], time.monotonic() + 20, chunk_bytes=CHUNK)
                outs.append(buf)
        return outs

    results = run_threads(n, fn)
    k = 0
    for root in range(n):
        for size in sizes:
            expected = payload(root, size, 100 * root + size)
            for r in range(n):
                np.testing.assert_array_equal(results[r][k], expected,
                                              err_msg=f"root {root} size {size} rank {r}")
            k += 1


@pytest.mark.timeout(60)
def test_broadcast_of_typed_array(world):
    n, w = world

    def fn(r):
        buf = np.full(n + 3, r, dtype=np.float64)
        broadcast(buf, n - 1, Group.of(range(n), r), w[r], time.monotonic() + 20)
        return buf

    for buf in run_threads(n, fn):
        assert (buf == n - 1).all()


@pytest.mark.timeout(60)
def test_alltoallv(world):
    n, w = world
    rng = np.random.default_rng(5)
    matrices = [np.zeros((n, n), int), rng.integers(0, 3, (n, n)),
                rng.integers(0, 20_000, (n, n))]  # matrix[j, k]: bytes j sends to k

    def block(j, k, m):
        return payload(j * 31 + k, int(matrices[m][j, k]), m)

    def fn(r):
        g = Group.of(range(n), r)
        outs = []
        for m, mat in enumerate(matrices):
            send = np.concatenate([block(r, k, m) for k in range(n)])
            recv = np.empty(int(mat[:, r].sum()), dtype=np.uint8)
            alltoallv(send, list(mat[r]), recv, list(mat[:, r]), g, w[r],
                      time.monotonic() + 20)
            outs.append(recv)
        return outs

    results = run_threads(n, fn)
    for m in range(len(matrices)):
        for r in range(n):
            expected = np.concatenate([block(j, r, m) for j in range(n)])
            np.testing.assert_array_equal(results[r][m], expected, err_msg=f"m{m} rank {r}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.float16, np.float32,
                                   np.float64, BFLOAT16])
def test_reducescatter(world, dtype):
    n, w = world
    dtype = np.dtype(dtype)
    count_lists = [[0] * n, [1] * n, [(2 * k + 1) % 4 for k in range(n)],
                   [10_007 // n + (k == 0) * (10_007 % n) for k in range(n)]]

    def data(r, total, c):
        rng = np.random.default_rng(r * 17 + c)
        if dtype.kind in "ui":
            return rng.integers(0, 100, total).astype(dtype)
        return rng.uniform(-1, 1, total).astype(dtype)

    def fn(r):
        g = Group.of(range(n), r)
        outs = []
        for c, counts in enumerate(count_lists):
            x = data(r, sum(counts), c)
            buf = x.astype(np.float32) if dtype == BFLOAT16 else x.copy()
            reducescatter(buf, counts, ReduceOp.Sum, g, w[r], time.monotonic() + 20,
                          chunk_bytes=CHUNK)
            outs.append(buf)
        return outs

    results = run_threads(n, fn)
    for c, counts in enumerate(count_lists):
        inputs = [data(r, sum(counts), c) for r in range(n)]
        if dtype.kind in "ui":
            expected = sum(x.astype(np.int64) for x in inputs).astype(dtype)
        else:
            expected = sum(x.astype(np.float64) for x in inputs)
        offs = np.concatenate([[0], np.cumsum(counts)])
        for r in range(n):
            got = results[r][c][offs[r]:offs[r + 1]]
            want = expected[offs[r]:offs[r + 1]]
            if dtype.kind in "ui":
                np.testing.assert_array_equal(got, want, err_msg=f"{counts} rank {r}")
            else:
                tol = 2e-2 if dtype == np.float16 else 1e-5
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol,
                                           err_msg=f"{counts} rank {r}")


def test_argument_checks():
    g = Group.of([0, 1], 0)
    dl = time.monotonic() + 1
    with pytest.raises(ValueError, match="expected 2 counts"):
        allgatherv(b"x", np.empty(1, np.uint8), [1], g, None, dl)
    with pytest.raises(ValueError, match="sends 2 bytes but counts\\[0\\] is 1"):
        allgatherv(b"xy", np.empty(2, np.uint8), [1, 1], g, None, dl)
    with pytest.raises(ValueError, match="root index 2 is outside the group"):
        broadcast(np.empty(1, np.uint8), 2, g, None, dl)
    with pytest.raises(ValueError, match="sum to 3 elements but the buffer has 4"):
        reducescatter(np.zeros(4), [1, 2], ReduceOp.Sum, g, None, dl)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        alltoallv(np.empty(0, np.uint8), [1, -1], np.empty(0, np.uint8), [0, 0], g, None, dl)
