"""The response cache: repeated calls are agreed on over the data plane (real worlds)."""

import pytest

import ddl
import _cache_checks
from ddl._cache import ResponseCache
from ddl._engine import Entry
from ddl.v1 import coordinator_pb2 as pb


def _run(fn, n, **env):
    results = ddl.run(fn, np=n, env=env or None)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.timeout(120)
def test_cache_in_a_3_rank_world():
    def both():
        return (_cache_checks.check_cache() + _cache_checks.check_inline_and_large()
                + _cache_checks.check_cached_data_ops() + _cache_checks.check_join_with_cache())
    _run(both, 3)


@pytest.mark.timeout(120)
def test_cache_over_tcp_cycles():
    """DDL_TRANSPORT=tcp: the cycles vote over TCP, no call is inline, results agree."""
    def run():
        from ddl import _runtime
        from ddl._cycles import TcpVotes
        cycles = _runtime.runtime().engine.cycles
        out = [] if isinstance(getattr(cycles, "_votes", None), TcpVotes) else [
            f"cycles run on {cycles and type(cycles._votes).__name__}"]
        return out + [f for f in _cache_checks.check_cache()
                      + _cache_checks.check_inline_and_large()
                      + _cache_checks.check_cached_data_ops()
                      + _cache_checks.check_join_with_cache()
                      if "inline=" not in f]
    _run(run, 2, DDL_TRANSPORT="tcp")


@pytest.mark.timeout(120)
def test_cache_disabled_gives_the_same_results():
    def run():
        from ddl import _runtime
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
