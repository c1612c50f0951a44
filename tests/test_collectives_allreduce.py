"""Allreduce algorithms over real loopback sockets, checked against NumPy."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from test_tcp_world import close_world, make_world, run_threads

from ddl.core.dtypes import BFLOAT16, ReduceOp
from ddl.dataplane.algorithms import allreduce, reduce_into
from ddl.dataplane.transports.base import Group

CHUNK = 4096
DTYPES = [np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_,
          BFLOAT16]
TOL = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def lengths(n):
    return sorted({0, 1, max(n - 1, 0), n + 1, 10_007})


def ops_for(dtype, length):
    if np.dtype(dtype) == np.bool_:
        return [ReduceOp.Min, ReduceOp.Max]
    if length in (0, 1):
        return [ReduceOp.Sum, ReduceOp.Max]
    return [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]


def cases(n):
    for dtype in DTYPES:
        for length in lengths(n):
            for op in ops_for(dtype, length):
                yield np.dtype(dtype), length, op


def data(rank, dtype, length, op, case):
    rng = np.random.default_rng(7919 * case + rank)
    if dtype == np.bool_:
        return rng.random(length) < (0.8 if op == ReduceOp.Min else 0.2)
    if dtype.kind in "ui":
        hi = 4 if op == ReduceOp.Product else min(np.iinfo(dtype).max, 1 << 20)
        return rng.integers(0, hi, length).astype(dtype)
    lo, hi = (0.5, 1.5) if op == ReduceOp.Product else (-1.0, 1.0)
    return rng.uniform(lo, hi, length).astype(dtype)


_REF = {ReduceOp.Sum: np.add, ReduceOp.Min: np.minimum, ReduceOp.Max: np.maximum,
        ReduceOp.Product: np.multiply}


def reference(inputs, dtype, op):
    if dtype == np.bool_:
        fn = np.logical_and if op == ReduceOp.Min else np.logical_or
        return functools.reduce(fn, inputs)
    if dtype.kind in "ui":
        return functools.reduce(lambda a, b: _REF[op](a, b, dtype=dtype), inputs)
    return functools.reduce(_REF[op], [x.astype(np.float64) for x in inputs])


def run_allreduce(world, n, algorithm):
    def fn(r):
        group = Group.of(range(n), r)
        out = []
        for case, (dtype, length, op) in enumerate(cases(n)):
            x = data(r, dtype, length, op, case)
            buf = x.astype(np.float32) if dtype == BFLOAT16 else x.copy()
            src = None
            if case % 2:  # out of place: the input stays, a dirty buf gets the result
                src, buf = buf, np.full_like(buf, 3)
                kept = src.copy()
            allreduce(buf, op, group, world[r] if world else None,
                      time.monotonic() + 20, algorithm=algorithm, small_message_bytes=1024,
                      chunk_bytes=CHUNK, src=src)
            if src is not None and not np.array_equal(src, kept):
                raise AssertionError(f"case {case}: allreduce wrote into src")
            out.append(buf)
        return out

    return run_threads(n, fn, timeout=60)


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def world(request):
    n = request.param
    w = make_world(n, poll_interval=0.05) if n > 1 else []
    yield n, w
    close_world(w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "auto"])
def test_allreduce_matches_numpy_and_is_bitwise_identical(world, algorithm):
    n, transports = world
    results = run_allreduce(transports, n, algorithm)
    for case, (dtype, length, op) in enumerate(cases(n)):
        inputs = [data(r, dtype, length, op, case) for r in range(n)]
        if dtype == BFLOAT16:
            inputs = [x.astype(np.float32) for x in inputs]
        expected = reference(inputs, dtype, op)
        label = f"n={n} {algorithm} {dtype} len={length} {op.name}"
        got0 = results[0][case]
        assert got0.shape == (length,), label
        if dtype.kind in "uib" or op in (ReduceOp.Min, ReduceOp.Max):
            np.testing.assert_array_equal(got0, expected.astype(got0.dtype), err_msg=label)
        else:
            tol = TOL.get(dtype, 1e-5)
            np.testing.assert_allclose(got0.astype(np.float64), expected, rtol=tol,
                                       atol=tol, err_msg=label)
        for r in range(1, n):
            assert results[r][case].tobytes() == got0.tobytes(), f"{label}: rank {r} differs"


def test_reduce_into_ops_and_bool_rules():
    a = np.array([1, 5, 3], dtype=np.int32)
    reduce_into(a, np.array([4, 2, 3], dtype=np.int32), ReduceOp.Max)
    assert a.tolist() == [4, 5, 3]
    b = np.array([True, True, False])
    reduce_into(b, np.array([True, False, False]), ReduceOp.Min)
    assert b.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="Sum is not defined on bool"):
        reduce_into(b, b.copy(), ReduceOp.Sum)
    with pytest.raises(ValueError, match="Product is not defined on bool"):
        reduce_into(b, b.copy(), ReduceOp.Product)
    with pytest.raises(ValueError, match="caller must run Sum and divide"):
        reduce_into(a, a.copy(), ReduceOp.Average)
    h = np.ones(3, dtype=BFLOAT16)
    reduce_into(h, np.ones(3, dtype=BFLOAT16), ReduceOp.Sum)
    assert h.astype(np.float32).tolist() == [2.0, 2.0, 2.0]


def test_allreduce_rejects_bad_input():
    g = Group.of([0], 0)
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        allreduce(np.zeros(3), ReduceOp.Sum, g, None, time.monotonic() + 1, algorithm="tree")
    with pytest.raises(ValueError, match="1-D contiguous"):
        allreduce(np.zeros((2, 2)), ReduceOp.Sum, g, None, time.monotonic() + 1)
    with pytest.raises(ValueError, match="not defined on bool"):
        allreduce(np.zeros(3, bool), ReduceOp.Sum, g, None, time.monotonic() + 1)
