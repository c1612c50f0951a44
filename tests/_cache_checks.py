"""Checks of the response cache, run inside every rank of a world (see test_cache.py)."""

from __future__ import annotations

import numpy as np

import ddl
from ddl.core.dtypes import BFLOAT16 as BF16
from ddl.dataplane.algorithms._shm_allreduce import ALLREDUCE_CMA_MIN
from ddl.runtime import runtime as _runtime


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
    # those blocking calls took the fast lane (ddl._fast), on shared memory or over TCP
    from ddl import _fast
    lane = _fast.lane(_runtime.runtime())
    if cycles is not None and (lane is None or lane.hits < 40):
        out.append(f"rank {r}: the fast lane completed {lane and lane.hits} of 60 calls")
    if cycles is None and lane is not None:
        out.append(f"rank {r}: a fast lane without cycles")
    # too large for the inline area: the fast lane runs the call's collective alone
    before = lane.hits if lane is not None else 0
    big = 100_000  # 400 KB of float32
    for step in range(6):
        expect(ddl.allreduce(np.full(big, r + step, np.float32), name="big/w", op=ddl.Sum),
               np.full(big, total + n * step, np.float32), f"large allreduce step {step}")
        expect(ddl.broadcast(np.full(big, r + step, np.int32), root_rank=n - 1, name="big/b"),
               np.full(big, n - 1 + step, np.int32), f"large broadcast step {step}")
        expect(ddl.allreduce(np.full(big, float(r), np.float64), name="big/avg"),
               np.full(big, total / n, np.float64), f"large average step {step}")
        expect(ddl.allreduce(np.full(big, 2.0 * r, np.float16), name="big/f16",
                             prescale_factor=0.5, postscale_factor=4.0),
               np.full(big, 4.0 * total / n, np.float16), f"large scaled f16 step {step}")
        expect(ddl.allreduce(np.full(big, r, BF16), name="big/bf16", op=ddl.Sum),
               np.full(big, total, BF16), f"large bfloat16 step {step}")
    # from ALLREDUCE_CMA_MIN on: on one host, the peers read the input (here a read-only
    # one: only ever read) and the result straight from this rank's memory where the
    # kernel allows
    huge = ALLREDUCE_CMA_MIN // 4 + 3
    for step in range(2):
        x = np.arange(huge, dtype=np.float32) % 1000 + r + step
        x.flags.writeable = False
        expect(ddl.allreduce(x, name="huge/w", op=ddl.Sum),
               (np.arange(huge) % 1000 * n + total + n * step).astype(np.float32),
               f"cross-memory allreduce step {step}")
        expect(ddl.allreduce(np.full(huge // 2, float(r)), name="huge/avg"),
               np.full(huge // 2, total / n), f"cross-memory average step {step}")
        strided = np.repeat(np.arange(huge, dtype=np.float32) % 1000 + r + step, 2)[::2]
        expect(ddl.allreduce(strided, name="huge/strided", op=ddl.Sum),
               (np.arange(huge) % 1000 * n + total + n * step).astype(np.float32),
               f"cross-memory allreduce of a strided input step {step}")
    # the last rank on the usual path meets the others' fast lane in the same cycle
    x = np.full(big, r, np.float32)
    got = (ddl.allreduce_async(x, name="big/w", op=ddl.Sum).wait() if r == n - 1
           else ddl.allreduce(x, name="big/w", op=ddl.Sum))
    expect(got, np.full(big, total, np.float32), "large allreduce, async on one rank")
    if cycles is not None and (lane is None or lane.hits - before < 20):
        out.append(f"rank {r}: the fast lane completed {lane and lane.hits - before} of 30 "
                   f"large calls")
    # a cached name already in flight (asynchronously) is refused as ever
    if r == 0:
        h = ddl.allreduce_async(np.ones(2), name="grad/w", op=ddl.Sum)
        try:
            ddl.allreduce(np.ones(2), name="grad/w", op=ddl.Sum)
            out.append(f"rank {r}: a blocking call of a name in flight did not raise")
        except ddl.DuplicateNameError:
            pass
        ddl.barrier()
        expect(h.wait(), np.full(2, n, np.float64), "the async call of the name")
    else:
        ddl.barrier()
        expect(ddl.allreduce(np.ones(2), name="grad/w", op=ddl.Sum),
               np.full(2, n, np.float64), "the blocking call of the name")
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


def check_inline_and_large() -> list:
    """Cached calls of every kind: inline (small) and as collectives (large), dtypes whose
    reduction differs, integer averages, broadcasts from every root, and an inline area
    that runs full."""
    from ddl.core.cache_signature import INLINE_AREA_BYTES, INLINE_MAX_BYTES
    out = []
    r, n = ddl.rank(), ddl.size()
    cache, _ = _cache()
    rng = np.random.default_rng(1234)  # the same on every rank
    big = INLINE_MAX_BYTES // 4 + 7          # float32 elements: just over the inline limit
    cases = [  # name, dtype, shape, op, postscale
        ("inl/f32", np.float32, (3, 5), ddl.Sum, 1.0),
        ("inl/bf16", BF16, (33,), ddl.Sum, 1.0),
        ("inl/f16avg", np.float16, (7,), ddl.Average, 1.0),
        ("inl/i32avg", np.int32, (11,), ddl.Average, 1.0),
        ("inl/i64max", np.int64, (4,), ddl.Max, 1.0),
        ("inl/boolmin", np.bool_, (9,), ddl.Min, 1.0),
        ("inl/f64post", np.float64, (6,), ddl.Sum, 0.5),
        ("inl/edge", np.float32, (INLINE_MAX_BYTES // 4,), ddl.Sum, 1.0),
        ("big/f32", np.float32, (big,), ddl.Sum, 1.0),
        ("big/bf16", BF16, (big,), ddl.Max, 1.0),
    ]
    base = {name: rng.integers(-50, 50, size=(n,) + shape) for name, _, shape, _, _ in cases}

    def want(name, dtype, op, post):
        v = base[name].astype(np.float64)
        if np.dtype(dtype) == np.bool_:
            return (base[name] > 0).all(axis=0)
        red = {ddl.Sum: v.sum(0), ddl.Max: v.max(0), ddl.Min: v.min(0)}.get(op)
        if op == ddl.Average:
            red = np.trunc(v.sum(0) / n) if np.dtype(dtype).kind == "i" else v.sum(0) / n
        return (red * post).astype(dtype)

    for step in range(4):
        handles = []
        for name, dtype, shape, op, post in cases:
            mine = base[name][r]
            x = (mine > 0) if np.dtype(dtype) == np.bool_ else mine.astype(dtype)
            handles.append(ddl.allreduce_async(x, name=name, op=op, postscale_factor=post))
        for (name, dtype, shape, op, post), h in zip(cases, handles):
            got = h.wait()
            exp = want(name, dtype, op, post)
            # a float16 Average sums inputs scaled by 1/n in float16: n ulps (the contract)
            tol = (n + 4) * float(np.finfo(np.float16).eps) if (
                np.dtype(dtype) == np.float16 and op == ddl.Average) else 0.0
            if got.dtype != np.dtype(dtype) or got.shape != shape or not np.allclose(
                    got.astype(np.float64), exp.astype(np.float64), rtol=tol, atol=0):
                out.append(f"rank {r}: cached {name} step {step}: got {got!r}, want {exp!r}")
        for root in range(n):
            x = np.full((2, 3), 10 * r + step, np.int16)
            got = ddl.broadcast(x, root_rank=root, name=f"inl/b{root}")
            if not np.array_equal(got, np.full((2, 3), 10 * root + step, np.int16)):
                out.append(f"rank {r}: cached broadcast root {root}: {got}")
        x = np.full(big, r + step, np.float32)
        got = ddl.broadcast(x, root_rank=n - 1, name="big/b")
        if not np.array_equal(got, np.full(big, n - 1 + step, np.float32)):
            out.append(f"rank {r}: cached large broadcast: {got[:4]}")
    # odd sizes through the cache: 0, 1, n-1, n+1, not a multiple of anything
    for step in range(3):
        for count in sorted({0, 1, n - 1, n + 1, 1001, INLINE_MAX_BYTES // 8 - 3}):
            for dtype in (np.float64, np.int16):
                x = (np.arange(count) % 7 + r).astype(dtype)
                got = ddl.allreduce(x, name=f"odd/{count}/{np.dtype(dtype).name}",
                                    op=ddl.Sum)
                want = (n * (np.arange(count) % 7) + n * (n - 1) // 2).astype(dtype)
                if got.dtype != want.dtype or not np.array_equal(got, want):
                    out.append(f"rank {r}: cached odd size {count} {np.dtype(dtype)} "
                               f"step {step}: {got[:5]}")
                b = ddl.broadcast(x, root_rank=n - 1, name=f"oddb/{count}/{np.dtype(dtype)}")
                if not np.array_equal(b, (np.arange(count) % 7 + n - 1).astype(dtype)):
                    out.append(f"rank {r}: cached odd broadcast {count} step {step}")
    inline = {cache.call(s).name: cache.call(s).inline >= 0 for s in cache.live_slots()}
    if not (inline.get("odd/1/float64") and inline.get("odd/0/float64") is False):
        out.append(f"rank {r}: odd sizes: 1 element should go inline, 0 not: "
                   f"{inline.get('odd/1/float64')}, {inline.get('odd/0/float64')}")
    for name, dtype, shape, _, _ in cases:
        if inline.get(name) != name.startswith("inl/"):
            out.append(f"rank {r}: slot of {name}: inline={inline.get(name)}")
    # fill the inline area: the names that no longer fit still work, as collectives
    per = INLINE_MAX_BYTES // 4
    for step in range(2):
        for k in range(INLINE_AREA_BYTES // INLINE_MAX_BYTES + 2):
            got = ddl.allreduce(np.full(per, r + k, np.float32), name=f"fill/{k}", op=ddl.Sum)
            if not np.array_equal(got, np.full(per, n * k + n * (n - 1) // 2, np.float32)):
                out.append(f"rank {r}: fill/{k} step {step}: {got[:3]}")
    # those past the area ride in the lone place (blocking calls: every rank picks them)
    cycles = _runtime.runtime().engine.cycles
    if cycles.inline:
        before = cycles.lone_hits
        for step in range(4):
            k = INLINE_AREA_BYTES // INLINE_MAX_BYTES + 1
            ddl.allreduce(np.full(per, r + k, np.float32), name=f"fill/{k}", op=ddl.Sum)
        if cycles.lone_hits - before < 2:
            out.append(f"rank {r}: {cycles.lone_hits - before} of 4 blocking calls with no "
                       f"inline place rode in the lone place")
    calls = [cache.call(s) for s in cache.live_slots()]
    used = sum(-(-c.nbytes // 64) * 64 for c in calls if c.inline >= 0)
    if used > INLINE_AREA_BYTES or any(c.inline + c.nbytes > INLINE_AREA_BYTES
                                       for c in calls if c.inline >= 0):
        out.append(f"rank {r}: the inline area overflows: {used} bytes")
    if not any(c.name.startswith("fill/") and c.inline < 0 for c in calls):
        out.append(f"rank {r}: the inline area never ran full")
    return out


def check_lone_place() -> list:
    """Cached calls with no inline place that ride in the cycle's lone place: blocking
    allreduces (Sum, Max, float16 Average, bfloat16 Average packed as float32, Adasum; Sum
    and Max of the size the group runs as reduce_scatter), broadcasts from every root,
    allgathers of different rows per rank, reducescatters of every wire form and alltoalls
    with uneven splits; one meeting another rank's usual path; an inline
    and a lone call in one round; and ranks that put different calls there (or none: two
    waiting at once), whose calls run as collectives instead. Results are exact, bitwise
    equal on every rank and bitwise the same as the first step's (the leader's collective),
    and every rank completed the same calls from the lone place."""
    import hashlib
    import time

    out = []
    r, n = ddl.rank(), ddl.size()
    _, cycles = _cache()
    lone_on = cycles is not None and cycles.inline
    rng = np.random.default_rng(99)  # the same on every rank
    a_in = rng.standard_normal((n, 30_000)).astype(np.float32)   # 120 KB
    b_in = rng.integers(-9, 9, size=(n, 20_001)).astype(np.int32)
    h_in = rng.integers(-9, 9, size=(n, 40_000)).astype(np.float16)  # 80 KB
    d_in = rng.standard_normal((n, 20_000)).astype(np.float32)   # Adasum, bfloat16
    big_in = rng.standard_normal((n, 100_000)).astype(np.float32)  # 400 KB: reduce_scatter
    first: dict = {}

    def same(x, what, step, as_first=True):
        """x bitwise equal on every rank, and (``as_first``) to this rank's result at
        step 0."""
        digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest(),
                               np.uint8)
        everyone = ddl.allgather(digest[None], name="lone/digest")
        if not (everyone == everyone[0]).all():
            out.append(f"rank {r}: {what} step {step} differs between ranks")
        if as_first and first.setdefault(what, digest.tobytes()) != digest.tobytes():
            out.append(f"rank {r}: {what} step {step} differs from step 0")

    def a_call(k, blocking=True):
        """lone/a on an input of its own (k), so that stale bytes would show."""
        x = a_in[r] + np.float32(k)
        if blocking:
            return ddl.allreduce(x, name="lone/a", op=ddl.Sum)
        return ddl.allreduce_async(x, name="lone/a", op=ddl.Sum)

    def check_a(got, k, what, step):
        if not np.allclose(got, (a_in + np.float32(k)).sum(0), rtol=1e-5, atol=1e-3):
            out.append(f"rank {r}: lone/a {what} step {step}: {got[:3]}")
        same(got, f"lone/a {what}", step, as_first=False)

    def hits():
        return cycles.lone_hits if lone_on else 0

    def summed(x_in, name, step):
        """A blocking Sum of this rank's row of ``x_in``: close to the exact sum, and
        bitwise what :func:`same` asks."""
        got = ddl.allreduce(x_in[r], name=name, op=ddl.Sum)
        if not np.allclose(got, x_in.sum(0), rtol=1e-5, atol=1e-4):
            out.append(f"rank {r}: {name} step {step}: {got[:3]}")
        same(got, name, step)

    before = hits()
    for step in range(4):
        summed(a_in, "lone/a", step)
        b = ddl.allreduce(b_in[r] * (step + 1), name="lone/b", op=ddl.Max)
        if not np.array_equal(b, b_in.max(0) * (step + 1)):
            out.append(f"rank {r}: lone/b step {step}: {b[:3]}")
        h = ddl.allreduce(h_in[r], name="lone/h16avg")   # Average
        want = (h_in.astype(np.float32) / n).sum(0).astype(np.float16)
        if h.dtype != np.float16 or not np.allclose(h, want, rtol=0, atol=0.01):
            out.append(f"rank {r}: lone/h16avg step {step}: {h[:3]} want {want[:3]}")
        same(h, "lone/h16avg", step)
        same(ddl.allreduce(d_in[r], name="lone/adasum", op=ddl.Adasum), "lone/adasum", step)
        same(ddl.allreduce(d_in[r].astype(BF16), name="lone/bf16avg"), "lone/bf16avg", step)
    allreduces = hits() - before
    if lone_on and allreduces < 10:
        out.append(f"rank {r}: {allreduces} of 20 blocking allreduces rode in the lone place")
    # above 512 KiB / ranks the group's collective is reduce_scatter, each rank reducing
    # its share with its own bytes first: the lone completion follows that order, so its
    # bits are the collective's (step 0, through the leader). (Max of -0.0 on rank 0 and
    # +0.0 elsewhere: the first operand wins, so even at 2 ranks the order shows.)
    zeros = np.full(100_000, -0.0 if r == 0 else 0.0, np.float32)
    before = hits()
    for step in range(4):
        summed(big_in, "lone/big", step)
        same(ddl.allreduce(zeros, name="lone/zeromax", op=ddl.Max), "lone/zeromax", step)
    if lone_on and hits() - before < 4:
        out.append(f"rank {r}: {hits() - before} of 8 blocking 400 KB allreduces rode in "
                   f"the lone place")
    before = hits()
    for step in range(3):
        for root in range(n):
            x = np.full(100_000, 10 * r + step, np.int16)      # 200 KB
            got = ddl.broadcast(x, root_rank=root, name=f"lone/bc{root}")
            if not np.array_equal(got, np.full(100_000, 10 * root + step, np.int16)):
                out.append(f"rank {r}: lone broadcast from {root} step {step}: {got[:3]}")
    if lone_on and hits() - before < 3 * n // 2:
        out.append(f"rank {r}: {hits() - before} of {3 * n} blocking broadcasts rode in "
                   f"the lone place")
    # allgathers whose ranks have different rows: each rank's rows in its own lone place
    # (the largest rank's past the inline limit)
    before = hits()
    for step in range(4):
        got = ddl.allgather(np.full((r + 1, 10_000), 10 * r + step, np.int32),
                            name="lone/ag")
        want = np.concatenate([np.full((k + 1, 10_000), 10 * k + step, np.int32)
                               for k in range(n)])
        if got.dtype != want.dtype or not np.array_equal(got, want):
            out.append(f"rank {r}: lone allgather step {step}: {got[:, :2].tolist()}")
    if lone_on and hits() - before < 2:
        out.append(f"rank {r}: {hits() - before} of 4 blocking allgathers rode in the lone "
                   f"place")
    # reducescatters and alltoalls, small (an inline place) and tiled past the inline
    # limit (the lone place): each rank takes its own part of the round. Results are
    # exact (or, for float Sums, bitwise the first step's: the leader's collective, whose
    # order the completion follows; Max of -0.0 on rank 0 and +0.0 elsewhere shows the
    # order even at 2 ranks), uneven row splits, every wire form
    rs_in = rng.standard_normal((n, 7, 300)).astype(np.float32)   # 7 rows: uneven blocks
    i_in = rng.integers(-2**40, 2**40, size=(n, 5, 40))
    i_sum = i_in.sum(0)
    cases = (  # name, input, op, the exact result (None: float, bitwise as step 0), and
        # the tiling (of the columns) that puts its packed input past the inline limit
        ("rs", rs_in[r], ddl.Sum, None, 10),
        ("rszero", np.full((7, 300), -0.0 if r == 0 else 0.0, np.float32), ddl.Max, None,
         10),
        ("rsf16avg", rs_in[r].astype(np.float16), ddl.Average, None, 20),
        ("rsbf16", rs_in[r].astype(BF16), ddl.Sum, None, 10),
        ("rsi32avg", (i_in[r] % 1000).astype(np.int32), ddl.Average,
         np.trunc((i_in % 1000).sum(0) / n).astype(np.int32), 60),
        ("rsi64avg", i_in[r], ddl.Average,   # two wire lanes per element
         (i_sum // n + ((i_sum % n != 0) & (i_sum < 0))).astype(np.int64), 30),
        ("rsboolmax", i_in[r] > 2**39, ddl.Max, (i_in > 2**39).any(0), 500),
    )

    def block(a):
        """This rank's block of dim 0 (earlier ranks get the extra rows)."""
        per = [a.shape[0] // n + (1 if k < a.shape[0] % n else 0) for k in range(n)]
        return a[sum(per[:r]):sum(per[:r + 1])]

    cache, _ = _cache()
    from ddl.core.cache_signature import INLINE_AREA_BYTES
    placed = [cache.call(s) for s in cache.live_slots()]
    room = INLINE_AREA_BYTES - sum(-(-c.nbytes // 64) * 64 for c in placed if c.inline >= 0)
    for where in ("inline", "lone"):
        before = hits()

        def tiled(a, k):
            return np.tile(a, (1, k)) if where == "lone" else a

        def check_rs(name, x, got, exact, k, step):
            if got.dtype != x.dtype or (exact is not None and not np.array_equal(
                    got, block(tiled(exact, k)))):
                out.append(f"rank {r}: {where} reducescatter {name} step {step}: {got!r}")
            if exact is None:
                digest = hashlib.sha256(np.ascontiguousarray(got).tobytes()).digest()
                if first.setdefault(name, digest) != digest:
                    out.append(f"rank {r}: {name} step {step} differs from step 0")

        def check_a2a(got, step):
            recv, got_splits = got
            sent = [(k + r) % 3 for k in range(n)]
            want = np.concatenate([np.full((sent[k], cols), 100 * k + 10 * r + step,
                                           np.int16) for k in range(n)])
            if not (recv.dtype == want.dtype and np.array_equal(recv, want)
                    and got_splits.tolist() == sent):
                out.append(f"rank {r}: {where} alltoall step {step}: "
                           f"{recv[:, :2].tolist()} {got_splits}")
            got_splits[:] = -1   # the caller's to keep: the next step's are fresh

        # alltoall: rank i sends (i + j) % 3 rows to rank j (some none)
        cols = 3 if where == "inline" else 20_000
        splits = [(r + j) % 3 for j in range(n)]

        def a2a_input(step):
            return np.concatenate([np.full((sp, cols), 100 * r + 10 * j + step, np.int16)
                                   for j, sp in enumerate(splits)])

        for step in range(4):   # one call at a time (the fast lane)
            for name, x, op, exact, k in cases:
                name = f"{where}/{name}"
                check_rs(name, x, ddl.reducescatter(tiled(x, k), name=name, op=op), exact,
                         k, step)
            mixed = step == 3 and r == n - 1   # the usual path meets the others' fast lane
            x = tiled(rs_in[r], 10)
            if mixed:
                got = ddl.reducescatter_async(x, name=f"{where}/rs", op=ddl.Sum).wait()
            else:
                got = ddl.reducescatter(x, name=f"{where}/rs", op=ddl.Sum)
            if not np.allclose(got, block(tiled(rs_in.sum(0), 10)), rtol=1e-5, atol=1e-4):
                out.append(f"rank {r}: {where} reducescatter rs step {step}: {got[0, :3]}")
            if mixed:
                check_a2a(ddl.alltoall_async(a2a_input(step), splits=splits,
                                             name=f"{where}/a2a").wait(), step)
            else:
                check_a2a(ddl.alltoall(a2a_input(step), splits=splits, name=f"{where}/a2a"),
                          step)
        lone_calls = hits() - before
        # then all of them at once, asynchronously, waited for in reverse order: several
        # ready in one cycle (small: one round, each in its inline place; large: their
        # collectives), and an allgather whose ranks' rows differ (its place holds the
        # largest rank's)
        ag_cols = 20 if where == "inline" else 10_000
        for step in range(4, 6):
            handles = [(f"{where}/{name}", x, ddl.reducescatter_async(
                tiled(x, k), name=f"{where}/{name}", op=op), exact, k)
                for name, x, op, exact, k in cases]
            ag = ddl.allgather_async(np.full((r + 1, ag_cols), 10 * r + step, np.int32),
                                     name=f"{where}/ag")
            a2a = ddl.alltoall_async(a2a_input(step), splits=splits, name=f"{where}/a2a")
            check_a2a(a2a.wait(), step)
            want = np.concatenate([np.full((j + 1, ag_cols), 10 * j + step, np.int32)
                                   for j in range(n)])
            got = ag.wait()
            if got.dtype != want.dtype or not np.array_equal(got, want):
                out.append(f"rank {r}: {where} allgather step {step}: "
                           f"{got[:, :2].tolist()}")
            for name, x, h, exact, k in reversed(handles):
                check_rs(name, x, h.wait(), exact, k, step)
        calls = 4 * (len(cases) + 2)   # the first step's go through the leader
        placed = {cache.call(s).name: cache.call(s).inline >= 0 for s in cache.live_slots()}
        names = [f"{where}/{c[0]}" for c in cases] + [f"{where}/a2a", f"{where}/ag"]
        if (lone_on and where == "inline" and room >= 64 * 1024   # (not run full before)
                and not all(placed.get(m) for m in names)):
            out.append(f"rank {r}: small reducescatters and alltoalls without an inline "
                       f"place: {[m for m in names if not placed.get(m)]}")
        if lone_on and where == "lone" and (any(placed.get(m, True) for m in names)
                                            or lone_calls < calls - len(names)):
            out.append(f"rank {r}: {lone_calls} of {calls} blocking reducescatters and "
                       f"alltoalls rode in the lone place (inline places: "
                       f"{[m for m in names if placed.get(m, True)]})")
    for step in range(3):
        k = 10 * step
        # the last rank on the usual path (an async call waited at once) meets the
        # others' fast lane
        got = a_call(k + 1) if r != n - 1 else a_call(k + 1, blocking=False).wait()
        check_a(got, k + 1, "mixed paths", step)
        # an inline call and a lone one in the same round (the usual path)
        hi = ddl.allreduce_async(np.full(100, r + step, np.float32), name="lone/small",
                                 op=ddl.Sum)
        ha = a_call(k + 2, blocking=False)
        if not np.array_equal(hi.wait(), np.full(100, n * (n - 1) // 2 + n * step,
                                                 np.float32)):
            out.append(f"rank {r}: inline beside a lone call step {step}")
        check_a(ha.wait(), k + 2, "beside an inline call", step)
        # rank 0 waits for two at once (no lone call: the two run fused) while the
        # others take them one by one
        if r == 0:
            ha = a_call(k + 3, blocking=False)
            hb = ddl.allreduce_async(b_in[r], name="lone/b", op=ddl.Max)
            ga, gb = ha.wait(), hb.wait()
        else:
            ga = a_call(k + 3)
            gb = ddl.allreduce(b_in[r], name="lone/b", op=ddl.Max)
        # then rank 0 starts b alone and, a moment later (its cycle thread has voted b
        # alone by then, past the cycle time), a blocking a, while the others vote a
        # alone: the lone places name different calls, then none on rank 0
        if r == 0:
            hb = ddl.allreduce_async(b_in[r], name="lone/b", op=ddl.Max)
            time.sleep(0.2)
            ga2 = a_call(k + 4)
            gb2 = hb.wait()
        else:
            ga2 = a_call(k + 4)
            gb2 = ddl.allreduce(b_in[r], name="lone/b", op=ddl.Max)
        for x, y, j, what in ((ga, gb, 3, "two at once"), (ga2, gb2, 4, "crossed")):
            if not np.array_equal(y, b_in.max(0)):
                out.append(f"rank {r}: lone/b {what} step {step}: {y[:3]}")
            check_a(x, k + j, what, step)
    # every rank completed the same calls from the lone place
    counts = ddl.allgather(np.array([hits()], np.int64), name="lone/hits")
    if not (counts == counts[0]).all():
        out.append(f"rank {r}: calls completed from the lone place per rank: {counts}")
    return out


def check_cached_data_ops() -> list:
    """Allgather (rows differ per rank), alltoall (with splits) and reducescatter through
    the cache; then one rank changes its rows or splits: the slot is dropped everywhere
    and the call goes through the leader, still correct."""
    out = []
    r, n = ddl.rank(), ddl.size()
    cache, _ = _cache()

    def expect(got, want, what):
        if not (np.asarray(got).dtype == np.asarray(want).dtype and np.array_equal(got, want)):
            out.append(f"rank {r}: {what}: got {got!r}, expected {want!r}")

    for step in range(6):
        extra = 1 if step >= 4 and r == n - 1 else 0  # the last rank grows at step 4
        rows = [k + 1 + (1 if step >= 4 and k == n - 1 else 0) for k in range(n)]
        got = ddl.allgather(np.full((r + 1 + extra, 2), r * 10 + step, np.int32), name="ag")
        want = np.concatenate([np.full((rows[k], 2), k * 10 + step, np.int32)
                               for k in range(n)])
        expect(got, want, f"cached allgather step {step}")
        # rank r sends (j + 1 + shift) rows to rank j; the shift changes at step 4
        shift = 1 if step >= 4 and r == 0 else 0
        splits = [j + 1 + shift for j in range(n)]
        x = np.concatenate([np.full(sp, 100 * r + j, np.int64) for j, sp in enumerate(splits)])
        recv, rsplits = ddl.alltoall(x, splits=splits, name="a2a")
        sent = [r + 1 + (1 if step >= 4 and k == 0 else 0) for k in range(n)]
        expect(rsplits, np.array(sent, np.int64), f"cached alltoall splits step {step}")
        expect(recv, np.concatenate([np.full(sent[k], 100 * k + r, np.int64)
                                     for k in range(n)]), f"cached alltoall step {step}")
        rs = ddl.reducescatter(np.arange(2 * n, dtype=np.float32) + step, name="rs",
                               op=ddl.Sum)
        expect(rs, (np.arange(2 * r, 2 * r + 2, dtype=np.float32) + step) * n,
               f"cached reducescatter step {step}")
        if step == 3:
            names = {cache.call(s).name for s in cache.live_slots()}
            if not {"ag", "a2a", "rs"} <= names:
                out.append(f"rank {r}: no cache slots for allgather/alltoall/"
                           f"reducescatter: {sorted(names)}")
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
    # join epochs in a row, each racing a cached call against the leader's flush (a rank
    # whose flush arrives after the flush cycle must not wait for another one)
    for epoch in range(6):
        for step in range(3):
            ddl.allreduce(np.ones(2, np.float32), name=f"j/epoch{epoch % 2}", op=ddl.Sum)
        if r != epoch % n:
            got = ddl.allreduce(np.ones(2, np.float32), name=f"j/epoch{epoch % 2}",
                                op=ddl.Sum)
            if not np.array_equal(got, np.full(2, n - 1, np.float32)):
                out.append(f"rank {r}: join epoch {epoch}: {got}")
        ddl.join()
    # after everyone joined, the job goes on and the cache works again
    for step in range(5):
        got = ddl.allreduce(np.ones(3, np.float32), name="j/grad2", op=ddl.Sum)
        if not np.array_equal(got, np.full(3, n, np.float32)):
            out.append(f"rank {r}: after join, step {step}: {got}")
    return out
