"""The reduction contract (README "Reductions", ``ddl.ReduceOp``) at every dtype's edges,
on every path: shared memory, the response cache (inline and as collectives, fused or
not), reducescatter, hierarchical on two simulated nodes, flat TCP (a process set across
the nodes here, ``DDL_TRANSPORT=tcp`` in test_cache.py). Ranks run with
``PYTHONWARNINGS=error::RuntimeWarning``: a NumPy overflow warning fails the call."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import ddl
from ddl.core import dtypes as _dtypes
from ddl.core.cache_signature import inline_bytes
from ddl.core.dtypes import BFLOAT16
from ddl.core.reduction import Reduction
from ddl.dataplane.algorithms import reduce_ufunc
from ddl.runtime.cache import CachedCall
from ddl.v1 import coordinator_pb2 as pb

import _reduction_checks

STRICT = {"PYTHONWARNINGS": "error::RuntimeWarning"}


def _failures(results):
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:60])


@pytest.mark.timeout(300)
def test_edges_over_shared_memory_and_the_cache():
    def run():
        return (_reduction_checks.check_edges()
                + _reduction_checks.check_scaled_and_joined())
    _failures(ddl.run(run, np=3, env=STRICT))


@pytest.mark.timeout(300)
def test_edges_hierarchical_and_tcp_on_two_nodes():
    """Global set: hierarchical (shared memory within a node, TCP across), cached calls
    agreed over TCP; the set {0, 2} (one rank per node): flat TCP."""
    def run():
        from ddl.dataplane.transports.base import Group
        from ddl.runtime import runtime as _runtime
        from ddl.v1 import coordinator_pb2 as pb
        backend = _runtime.runtime().backends.pick(pb.ALLREDUCE,
                                                   Group.of(range(4), ddl.rank()), 4)
        out = [] if backend.name == "shm+tcp" else [
            f"rank {ddl.rank()}: the global set does not run hierarchically"]
        out += _reduction_checks.check_edges()
        if ddl.rank() in (0, 2):  # only members add a set
            ps = ddl.add_process_set([0, 2])
            out += _reduction_checks.check_edges(ps, tag="ps/")
        ddl.barrier()
        return out
    _failures(ddl.run(run, np=4, env=dict(STRICT, DDL_TEST_LOCAL_NODES="2,2",
                                          DDL_HIERARCHICAL_ALLREDUCE="on")))


def _simulate(plan: Reduction, inputs, joined: int = 0):
    """What the ranks compute: pack every input, Sum/Min/... the wire buffers in rank
    order (``joined`` more ranks contribute the neutral value), finish."""
    count = inputs[0].size
    bufs = []
    for x in inputs:
        b = np.empty(plan.wire_count(count), plan.wire)
        plan.pack(x, b)
        bufs.append(b)
    for _ in range(joined):
        b = np.empty(plan.wire_count(count), plan.wire)
        plan.fill_neutral(b)
        bufs.append(b)
    fn = reduce_ufunc(plan.wire, plan.algo_op)
    acc = bufs[0].copy()
    with np.errstate(all="ignore"):  # as the executor runs the algorithms
        for b in bufs[1:]:
            fn(acc, b, out=acc)
    return plan.finish(acc, np.empty(count, plan.dtype))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_the_plan_at_every_edge_for_many_contributors(n):
    """The plan alone (no processes), for world sizes the worlds above do not reach;
    NumPy warnings are errors here too."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (_reduction_checks.INT_DTYPES + _reduction_checks.FLOAT_DTYPES
                      + [np.dtype(np.bool_)]):
            for op in _reduction_checks._ops(dtype):
                cols = [_reduction_checks.columns(dtype, op, r, n) for r in range(n)]
                inputs = [np.array(c, dtype) for c in cols]
                want = _reduction_checks.expected(cols, op, dtype)
                for joined in (0, 2):
                    plan = Reduction(dtype, op, contributors=n)
                    why = _reduction_checks.mismatch(_simulate(plan, inputs, joined), want,
                                                     dtype, n)
                    assert not why, f"{dtype} {op.name} n={n} joined={joined}: {why}"


def test_integer_average_is_exact_and_scaling_clips():
    i64 = np.iinfo(np.int64)
    plan = Reduction(np.int64, ddl.Average, contributors=3)
    got = _simulate(plan, [np.array([i64.max, i64.min, -1, 5], np.int64)] * 3)
    assert got.tolist() == [i64.max, i64.min, -1, 5]
    got = _simulate(plan, [np.array([i64.min, -7]), np.array([i64.min, 0]),
                           np.array([i64.min + 1, 0])])
    assert got.tolist() == [i64.min + 1, -2]  # (3 * min + 1) / 3, -7 / 3: toward zero
    plan = Reduction(np.uint8, ddl.Average, contributors=4)
    assert _simulate(plan, [np.array([v], np.uint8) for v in (255, 254, 253, 252)]
                     ).tolist() == [253]
    # scaled integers clip to the dtype's range instead of wrapping
    plan = Reduction(np.int8, ddl.Sum, prescale=4.0, postscale=0.5, contributors=2)
    assert _simulate(plan, [np.array([100, -100, 3], np.int8)] * 2).tolist() == [-1, 0, 12]
    plan = Reduction(np.int64, ddl.Average, prescale=2.0, contributors=2)
    assert _simulate(plan, [np.array([i64.max, -3], np.int64)] * 2).tolist() == [
        int(np.nextafter(2.0 ** 63, 0)), -6]


def test_float16_average_rounds_once_and_the_cache_layout_follows_the_wire():
    """float16 Average travels as float16 (Compression.fp16 halves the wire), each input
    scaled by 1/n with one rounding, and the result by its postscale factor with one."""
    plan = Reduction(np.float16, ddl.Average, contributors=4)
    assert (plan.wire, plan.lanes, plan.reads_input) == (np.float16, 1, False)
    assert _simulate(plan, [np.full(2, 40000, np.float16)] * 4).tolist() == [40000] * 2
    # one rounding: the float16 nearest to x * float32(1/3), not a double rounding
    plan = Reduction(np.float16, ddl.Average, contributors=3)
    x = np.arange(1, 2049, dtype=np.float16) * np.float16(7)
    got = np.empty(x.size, np.float16)
    plan.pack(x, got)
    exact = x.astype(np.float64) * np.float64(np.float32(1 / 3))
    assert np.array_equal(got, exact.astype(np.float16))
    # a postscale too: float16 times the float32 factor, rounded once (as Horovod scales)
    plan = Reduction(np.float16, ddl.Sum, postscale=0.19151945, contributors=2)
    summed = x.copy()
    got = plan.finish(summed, np.empty(x.size, np.float16))
    exact = x.astype(np.float64) * np.float64(np.float32(0.19151945))
    assert np.array_equal(got, exact.astype(np.float16))
    plan = Reduction(np.float32, ddl.Average, contributors=1)
    assert plan.reads_input and plan.in_place  # one rank: the input is the wire form
    assert Reduction(BFLOAT16, ddl.Max).wire == np.float32
    # the leader sizes the inline area (inline_bytes) as the ranks' plan packs it
    for dtype, op, size in [(np.int8, ddl.Average, 8), (np.int64, ddl.Average, 16),
                            (np.float16, ddl.Average, 2), (np.float16, ddl.Sum, 2),
                            (BFLOAT16, ddl.Sum, 4), (np.int32, ddl.Sum, 4)]:
        req = pb.Request(name="g", op=pb.ALLREDUCE, dtype=_dtypes.to_wire(dtype),
                         shape=[3, 5], reduce_op=int(op))
        resp = pb.Response(op=pb.ALLREDUCE, dtype=req.dtype, reduce_op=req.reduce_op,
                           prescale_factor=1.0, postscale_factor=1.0, member_ranks=[0, 1],
                           tensors=[pb.TensorEntry(name="g", shape=[3, 5], cache_slot=1,
                                                   cache_inline_offset=0)])
        call = CachedCall(1, resp, resp.tensors[0], req)
        assert inline_bytes(req) == call.nbytes == 15 * size, (dtype, op)


def test_the_executor_makes_each_plan_once_and_tells_signed_zero_factors_apart():
    from ddl.dataplane.transports.base import Group
    from ddl.runtime.execute import Executor

    executor = Executor(0, backends=None, timeout=1.0)
    group = Group.of([0, 1], 0)

    def plan(prescale, joined=()):
        return executor.reduction(pb.Response(
            op=pb.ALLREDUCE, dtype=pb.FLOAT32, reduce_op=int(ddl.Sum),
            prescale_factor=prescale, postscale_factor=1.0, member_ranks=[0, 1],
            joined_ranks=list(joined)), group)

    assert plan(2.0) is plan(2.0)
    assert plan(2.0, joined=[1]).contributors == 1 and plan(2.0).contributors == 2
    signs = []
    for factor in (0.0, -0.0):  # equal as numbers, but they scale to zeros of either sign
        out = np.empty(2, np.float32)
        plan(factor).pack(np.ones(2, np.float32), out)
        signs.append(np.signbit(out).tolist())
    assert signs == [[False, False], [True, True]]
