"""The response cache: repeated calls are agreed on over the data plane (real worlds)."""

import pytest

import ddl
from ddl.runtime.cache import ResponseCache
from ddl.runtime.engine import Entry
from ddl.v1 import coordinator_pb2 as pb

import _cache_checks
import _reduction_checks


def _run(fn, n, **env):
    results = ddl.run(fn, np=n, env=env or None)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.timeout(120)
def test_cache_in_a_3_rank_world():
    def both():
        # (the lone place's checks before the inline area runs full: they use it too)
        return (_cache_checks.check_cache() + _cache_checks.check_lone_place()
                + _cache_checks.check_inline_and_large()
                + _cache_checks.check_cached_data_ops()
                + _cache_checks.check_join_with_cache())
    _run(both, 3)


@pytest.mark.timeout(120)
def test_lone_place_in_a_2_rank_world():
    _run(_cache_checks.check_lone_place, 2)


@pytest.mark.timeout(120)
def test_cache_over_tcp_cycles():
    """DDL_TRANSPORT=tcp: the cycles vote over TCP, no call is inline, results agree; the
    reduction contract at every dtype's edges holds over flat TCP too."""
    def run():
        from ddl.dataplane.backends.tcp import TcpVotes
        from ddl.runtime import runtime as _runtime
        cycles = _runtime.runtime().engine.cycles
        out = [] if isinstance(getattr(cycles, "_votes", None), TcpVotes) else [
            f"cycles run on {cycles and type(cycles._votes).__name__}"]
        return out + [f for f in _cache_checks.check_cache()
                      + _cache_checks.check_inline_and_large()
                      + _cache_checks.check_lone_place()
                      + _cache_checks.check_cached_data_ops()
                      + _cache_checks.check_join_with_cache()
                      if "inline=" not in f] + _reduction_checks.check_edges(tag="tcp/")
    _run(run, 2, DDL_TRANSPORT="tcp", PYTHONWARNINGS="error::RuntimeWarning")


@pytest.mark.timeout(120)
def test_cache_disabled_gives_the_same_results():
    def run():
        from ddl.runtime import runtime as _runtime
        out = [] if _runtime.runtime().engine.cache is None else ["the cache runs"]
        return out + [f for f in _cache_checks.check_cache()
                      if "the response cache is not running" not in f
                      and "expected cached slots" not in f]
    _run(run, 2, DDL_CACHE_CAPACITY="0")


def test_cache_lookup_and_drop():
    cache = ResponseCache(4)
    resp = pb.Response(op=pb.ALLREDUCE, dtype=pb.FLOAT32, reduce_op=pb.SUM,
                       prescale_factor=1.0, postscale_factor=1.0, member_ranks=[0, 1],
                       tensors=[pb.TensorEntry(name="g", shape=[3], cache_slot=2)])
    req = pb.Request(name="g", op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=[3],
                     reduce_op=pb.SUM)
    entries = {"g": Entry(pb.Request(), None, None)}
    entries["g"].request.CopyFrom(req)
    cache.insert(resp, entries)
    call, stale = cache.lookup(req)
    assert (call.slot, call.name, call.count, call.inline, stale) == (2, "g", 3, -1, 0)
    assert cache.lookup(pb.Request(name="g", op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=[4],
                                   reduce_op=pb.SUM)) == (None, 2)
    req.postscale_factor = 2.0
    assert cache.lookup(req) == (None, 2)  # a scale factor is part of the signature
    cache.drop([2])
    assert cache.lookup(req) == (None, 0)
    cache.insert(resp, entries)  # a dropped slot is never used again
    assert cache.live_slots() == []


def _opposite_cached_calls():
    import time

    import numpy as np
    r = ddl.rank()
    for _ in range(3):  # both names cached
        ddl.allreduce(np.ones(2), name="A", op=ddl.Sum)
        ddl.allreduce(np.ones(2), name="B", op=ddl.Sum)
    start = time.monotonic()
    try:
        ddl.allreduce(np.ones(2), name="A" if r == 0 else "B", op=ddl.Sum)
        return f"rank {r}: no error"
    except ddl.StallError as exc:
        took = time.monotonic() - start
        return "" if ("cached" in str(exc) and took < 10) else f"rank {r}: {exc} ({took:.1f} s)"
    except ddl.DDLError as exc:  # the other rank's stall reaches this one as its cause
        took = time.monotonic() - start
        return "" if took < 10 else f"rank {r}: {exc!r} ({took:.1f} s)"


@pytest.mark.timeout(60)
def test_cached_calls_waited_for_in_opposite_orders_end_in_a_stall_error():
    """Rank 0 waits on cached A, rank 1 on cached B: their cycles make no progress, and
    both raise within seconds of DDL_STALL_SHUTDOWN_TIME_SECONDS, instead of cycling."""
    try:
        results = ddl.run(_opposite_cached_calls, np=2,
                          env={"DDL_STALL_CHECK_TIME_SECONDS": "0.5",
                               "DDL_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    except ddl.RunError as exc:  # a rank may end the job with the error first
        assert "StallError" in str(exc), exc
        return
    assert results == ["", ""], results


def test_a_cycle_outcome_names_its_ready_and_dropped_slots():
    import numpy as np

    from ddl.runtime.cycles import _DROP, _slots_at

    outcome = np.zeros(1025, np.int8)
    outcome[[0, 7, 1024]] = -1  # slot 0 marks a flush, not a slot
    outcome[[1, 300]] = 1
    votes = outcome.tobytes()
    assert _slots_at(votes, _DROP) == [7, 1024]
    assert _slots_at(votes, 1) == [1, 300]
    assert _slots_at(bytes(8), 1) == []


def _cycle_time_world():
    """DDL_CYCLE_TIME_MS=20000: asynchronous cached calls wait for a thread that waits for
    them, which runs them fused, as views of one aligned buffer; a rank that blocks on a
    call the leader answers lets the cycle thread start its cached calls at once."""
    import time

    import numpy as np

    from ddl.runtime import runtime as _runtime
    out, r, n = [], ddl.rank(), ddl.size()
    cycles = _runtime.runtime().engine.cycles
    if cycles._cycle_time != 20.0:
        out.append(f"rank {r}: cycle time {cycles._cycle_time}")
    sizes = (17001, 20000, 16387, 70000)  # past the inline area; most not multiples of 16
    for step in range(4):
        start = time.monotonic()
        hs = [ddl.allreduce_async(np.full(k, r + step + i, np.float32), name=f"cyc/{i}",
                                  op=ddl.Sum) for i, k in enumerate(sizes)]
        got = [h.wait() for h in hs]
        took = time.monotonic() - start
        if took > 10:
            out.append(f"rank {r}: step {step} waited {took:.1f} s for the cycle time")
        for i, (k, g) in enumerate(zip(sizes, got)):
            want = np.full(k, n * (step + i) + n * (n - 1) // 2, np.float32)
            if not np.array_equal(g, want):
                out.append(f"rank {r}: cyc/{i} step {step}: {g[:3]}")
        if step == 3:  # cached: one fused cycle; its results share one aligned buffer
            big = [g for g in got if g.nbytes >= 4096]
            if len({id(g.base) for g in got}) != 1:
                out.append(f"rank {r}: fused results in {len({id(g.base) for g in got})} "
                           f"buffers")
            if any(g.ctypes.data % 64 for g in big):
                out.append(f"rank {r}: a fused result is not 64-byte aligned")
            got[0][:] = -1  # views, but of disjoint parts
            if any((g == -1).any() for g in got[1:]):
                out.append(f"rank {r}: fused results overlap")
    # the cycle thread, woken by a batch's first call while a waiter ran that batch's
    # cycle, wakes to find nothing waiting and waits for the waiter's lock; by the time it
    # has it, the next batch has begun to arrive: that part waits its cycle time too, and
    # the batch runs fused in one cycle (it ran the part at once, split from the rest)
    def batch(step, names):
        return [ddl.allreduce_async(np.full(sizes[i], r + step + i, np.float32),
                                    name=f"cyc/{i}", op=ddl.Sum) for i in names]

    if r == 0:
        hs = batch(4, range(4))
        [h.wait() for h in hs]
        hs = batch(5, range(4))
    else:
        with cycles._cond:  # the thread, woken by the first add, cannot look until done
            hs = batch(4, range(4))
            [h.wait() for h in hs]
            cycles._driving.acquire()
        time.sleep(0.3)  # it finds nothing waiting, and waits for the lock
        hs = batch(5, range(2))
        cycles._driving.release()
        time.sleep(0.5)
        hs += batch(5, range(2, 4))
    got = [h.wait() for h in hs]
    for i, (k, g) in enumerate(zip(sizes, got)):
        if not np.array_equal(g, np.full(k, n * (5 + i) + n * (n - 1) // 2, np.float32)):
            out.append(f"rank {r}: cyc/{i} step 5: {g[:3]}")
    if len({id(g.base) for g in got}) != 1:
        out.append(f"rank {r}: a batch that came while the cycle thread waited for a "
                   f"waiter's cycle ran in {len({id(g.base) for g in got})} buffers")
    # rank 0 waits for the leader's answer (B) while its cached A waits in cycles, and
    # rank 1 waits on A first: the nudge starts A at once, not after 20 s
    for _ in range(2):
        ddl.allreduce(np.ones(3), name="nudge/A", op=ddl.Sum)
    start = time.monotonic()
    if r == 0:
        h = ddl.allreduce_async(np.ones(3), name="nudge/A", op=ddl.Sum)
        b = ddl.allreduce(np.ones(2), name="nudge/B", op=ddl.Sum)
        a = h.wait()
    else:
        a = ddl.allreduce(np.ones(3), name="nudge/A", op=ddl.Sum)
        b = ddl.allreduce(np.ones(2), name="nudge/B", op=ddl.Sum)
    took = time.monotonic() - start
    if not (np.all(a == n) and np.all(b == n)) or took > 10:
        out.append(f"rank {r}: nudged calls: {a} {b} in {took:.1f} s")
    return out


@pytest.mark.timeout(120)
def test_cycle_time_fused_views_and_nudge():
    _run(_cycle_time_world, 2, DDL_CYCLE_TIME_MS="20000")


def test_default_cycle_time_follows_the_cpus_per_local_rank(monkeypatch):
    from ddl.runtime import runtime as _rt
    assert _rt.cycle_time_s(7.0, 1) == 0.007  # DDL_CYCLE_TIME_MS wins
    monkeypatch.setattr(_rt, "usable_cpus", lambda: 16)
    assert _rt.cycle_time_s(None, 8) == 0.0  # two CPUs per local rank: start at once
    assert _rt.cycle_time_s(None, 9) == _rt.CROWDED_CYCLE_TIME_MS / 1000
    monkeypatch.setattr(_rt, "usable_cpus", lambda: 2)
    assert _rt.cycle_time_s(None, 2) == _rt.CROWDED_CYCLE_TIME_MS / 1000
