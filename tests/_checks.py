"""Checks that run inside every rank of a test world.

Each rank can recompute every other rank's input (inputs are seeded by rank and case),
so each rank checks its own results exactly against NumPy and returns a list of failure
strings. A world checks many things at once: worlds are expensive on 2 cores.
"""

from __future__ import annotations

import re
import zlib

import ml_dtypes
import numpy as np

import ddl

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, BF16,
          np.float32, np.float64, np.bool_]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4)]
OPS = [ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make(dtype, shape, rank: int, case, positive: bool = False) -> np.ndarray:
    """Deterministic input of ``rank`` for ``case``."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(_seed(rank, case))
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        lo = 1 if positive else (0 if dtype.kind == "u" else -5)
        return rng.integers(lo, 4 if positive else 10, size=shape).astype(dtype)
    if positive:
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(dtype)


def _tol(dtype):
    dtype = np.dtype(dtype)
    if dtype == BF16:
        return 2e-2
    return {2: 5e-3, 4: 1e-5, 8: 1e-12}.get(dtype.itemsize, 0) if dtype.kind == "f" else 0


def reference_allreduce(inputs, op, dtype):
    dtype = np.dtype(dtype)
    n = len(inputs)
    if dtype.kind == "b":
        stack = np.stack(inputs)
        return stack.all(axis=0) if op == ddl.Min else stack.any(axis=0)
    if dtype.kind in "iu":
        stack = np.stack(inputs).astype(np.int64)
        if op in (ddl.Sum, ddl.Average):
            s = stack.sum(axis=0)
            if op == ddl.Average:
                s = np.abs(s) // n * np.sign(s)
            return s.astype(dtype)
        if op == ddl.Product:
            return stack.prod(axis=0).astype(dtype)
        return (stack.min(axis=0) if op == ddl.Min else stack.max(axis=0)).astype(dtype)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if op == ddl.Sum:
        return stack.sum(axis=0)
    if op == ddl.Average:
        return stack.sum(axis=0) / n
    if op == ddl.Product:
        return stack.prod(axis=0)
    return stack.min(axis=0) if op == ddl.Min else stack.max(axis=0)


def close(got, want, dtype) -> bool:
    dtype = np.dtype(dtype)
    got = np.asarray(got)
    if got.dtype != dtype or got.shape != np.shape(want):
        return False
    tol = _tol(dtype)
    if tol == 0:
        return np.array_equal(got, want)
    return np.allclose(got.astype(np.float64), np.asarray(want, dtype=np.float64), rtol=tol,
                       atol=tol)


def check_collectives() -> list:
    """Every collective x dtype x shape (0-3 dims, empty, non-contiguous) on this world."""
    rank, size = ddl.rank(), ddl.size()
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(f"rank {rank}: {what}")

    # allreduce: every op x dtype x shape, synchronously
    for dtype in DTYPES:
        for shape in SHAPES:
            for op in OPS:
                if np.dtype(dtype).kind == "b" and op not in (ddl.Min, ddl.Max):
                    continue
                case = ("ar", np.dtype(dtype).name, shape, int(op))
                positive = op == ddl.Product
                inputs = [make(dtype, shape, r, case, positive) for r in range(size)]
                mine = inputs[rank].copy()
                got = ddl.allreduce(mine, name=f"ar/{np.dtype(dtype).name}/{shape}/{op.name}",
                                    op=op)
                expect(np.array_equal(mine, inputs[rank]), f"allreduce modified its input {case}")
                expect(close(got, reference_allreduce(inputs, op, dtype), dtype),
                       f"allreduce {case}: got {got!r}")

    # bool with Sum is refused on every rank with a clear error
    try:
        ddl.allreduce(np.ones(3, dtype=bool), name="ar/bool/sum", op=ddl.Sum)
        expect(False, "allreduce bool Sum did not raise")
    except ddl.InvalidRequestError as exc:
        expect("bool" in str(exc) and "ar/bool/sum" in str(exc), f"bool Sum message: {exc}")

    # non-contiguous input, scale factors (float and integer truncation)
    base = np.arange(20, dtype=np.float32).reshape(4, 5) + rank
    got = ddl.allreduce(base[:, ::2], name="ar/strided", op=ddl.Sum)
    want = sum((np.arange(20, dtype=np.float32).reshape(4, 5) + r)[:, ::2] for r in range(size))
    expect(np.array_equal(got, want), f"strided allreduce: {got}")
    got = ddl.allreduce(np.full(3, 2.0, np.float32), name="ar/scaled", op=ddl.Sum,
                        prescale_factor=0.5, postscale_factor=3.0)
    expect(np.allclose(got, 3.0 * size), f"scaled allreduce: {got}")
    got = ddl.allreduce(np.full(3, 3, np.int32), name="ar/scaled/int", op=ddl.Sum,
                        prescale_factor=0.5)
    # integer scaling truncates toward zero: 0.5 * 3 -> 1 on each rank, summed -> size
    expect(got.dtype == np.int32 and np.array_equal(got, np.full(3, size, np.int32)),
           f"int prescale: {got}")

    # async + fusion: many small tensors in flight at once, submitted in rank-rotated order
    names = [f"fuse/{i}" for i in range(24)]
    order = names[rank % len(names):] + names[:rank % len(names)]
    handles = {n: ddl.allreduce_async(np.full(5, float(int(n.split('/')[1]) + rank), np.float32),
                                      name=n, op=ddl.Sum) for n in order}
    for n in names:
        i = int(n.split("/")[1])
        got = ddl.synchronize(handles[n])
        expect(np.allclose(got, size * i + size * (size - 1) / 2), f"fused {n}: {got}")

    # pytree and grouped allreduce keep structure
    tree = {"w": np.ones((2, 2), np.float32) * rank, "b": [np.arange(3), np.float64(rank)]}
    out = ddl.allreduce(tree, name="tree", op=ddl.Sum)
    s = size * (size - 1) / 2
    expect(isinstance(out, dict) and isinstance(out["b"], list), f"tree structure {type(out)}")
    expect(np.allclose(out["w"], s) and np.array_equal(out["b"][0], np.arange(3) * size)
           and np.allclose(out["b"][1], s), f"tree values {out}")
    outs = ddl.grouped_allreduce([np.ones(2, np.float32), np.ones(3, np.int64)], name="grp",
                                 op=ddl.Sum)
    expect(len(outs) == 2 and np.all(outs[0] == size) and outs[1].dtype == np.int64
           and np.all(outs[1] == size), f"grouped {outs}")
    # grouped allgather (uneven dim 0 per array) and reducescatter: one group each
    ga = ddl.grouped_allgather([np.full((rank + 1, 2), rank, np.float32),
                                np.arange(rank, dtype=np.int32)], name="grp/ag")
    expect(len(ga) == 2 and np.array_equal(ga[0], np.concatenate(
        [np.full((r + 1, 2), r, np.float32) for r in range(size)])) and np.array_equal(
        ga[1], np.concatenate([np.arange(r, dtype=np.int32) for r in range(size)])),
        f"grouped allgather {ga}")
    rows = 2 * size + 1
    grs = ddl.grouped_reducescatter([np.ones((rows, 2), np.float32) * (rank + 1),
                                     np.arange(size, dtype=np.int64)], name="grp/rs",
                                    op=ddl.Sum)
    base, extra = divmod(rows, size)
    mine = base + (rank < extra)
    expect(len(grs) == 2 and grs[0].shape == (mine, 2) and np.all(grs[0] == s + size)
           and np.array_equal(grs[1], [size * rank]), f"grouped reducescatter {grs}")

    # allgather: uneven first dimension (rank 0 sends zero rows), every dtype, 1-3 dims
    for dtype in DTYPES:
        for tail in [(), (3,), (2, 2)]:
            case = ("ag", np.dtype(dtype).name, tail)
            inputs = [make(dtype, (r,) + tail, r, case) for r in range(size)]
            got = ddl.allgather(inputs[rank], name=f"ag/{np.dtype(dtype).name}/{tail}")
            want = np.concatenate(inputs, axis=0)
            expect(got.dtype == want.dtype and np.array_equal(got, want),
                   f"allgather {case}: {got.shape} vs {want.shape}")

    # broadcast: every dtype x shape from every root
    for root in range(size):
        for dtype in DTYPES:
            for shape in SHAPES:
                case = ("bc", root, np.dtype(dtype).name, shape)
                inputs = [make(dtype, shape, r, case) for r in range(size)]
                got = ddl.broadcast(inputs[rank], root_rank=root,
                                    name=f"bc/{root}/{np.dtype(dtype).name}/{shape}")
                expect(got.dtype == np.dtype(dtype) and np.array_equal(got, inputs[root]),
                       f"broadcast {case}")

    # broadcast of a strided input (the root copies it first) and of a contiguous one of
    # several MiB (the root reads it in place while it sends it): the root's result is a
    # new array and every input is left as it was
    rows = 600_000
    whole = np.arange(2 * rows, dtype=np.float32).reshape(rows, 2)
    for label, x, want in (("strided", (whole + rank)[:, 0], whole[:, 0]),
                           ("contiguous", whole + rank, whole)):
        kept = x.copy()
        got = ddl.broadcast(x, root_rank=0, name=f"bc/{label}")
        expect(np.array_equal(got, want) and not np.shares_memory(got, x)
               and np.array_equal(x, kept), f"broadcast of a {label} input")

    # alltoall: uneven splits, including zeros
    for dtype in DTYPES:
        case = ("a2a", np.dtype(dtype).name)
        splits = {r: [(r + j) % 3 for j in range(size)] for r in range(size)}
        inputs = [make(dtype, (sum(splits[r]), 2), r, case) for r in range(size)]
        got, rsplits = ddl.alltoall(inputs[rank], splits=splits[rank],
                                    name=f"a2a/{np.dtype(dtype).name}")
        parts = []
        for r in range(size):
            off = sum(splits[r][:rank])
            parts.append(inputs[r][off:off + splits[r][rank]])
        want = np.concatenate(parts, axis=0)
        expect(np.array_equal(got, want) and list(rsplits) == [splits[r][rank] for r in range(size)],
               f"alltoall {case}")
    got, rsplits = ddl.alltoall(np.arange(2 * size) + 100 * rank, name="a2a/even")
    want = np.concatenate([np.arange(2 * size)[2 * rank:2 * rank + 2] + 100 * r
                           for r in range(size)])
    expect(np.array_equal(got, want) and list(rsplits) == [2] * size, f"alltoall even {got}")

    # reducescatter: rows split as evenly as possible, earlier ranks get the extra row
    for rows in [size + 1, max(size - 1, 1), 2 * size]:
        for dtype, op in [(d, OPS[i % len(OPS)]) for i, d in enumerate(DTYPES)
                          if np.dtype(d).kind != "b"] + [(np.bool_, ddl.Max)]:
            case = ("rs", rows, np.dtype(dtype).name, int(op))
            inputs = [make(dtype, (rows, 3), r, case, op == ddl.Product) for r in range(size)]
            got = ddl.reducescatter(inputs[rank], op=op,
                                    name=f"rs/{rows}/{np.dtype(dtype).name}/{op.name}")
            full = reference_allreduce(inputs, op, dtype)
            base_rows, extra = divmod(rows, size)
            counts = [base_rows + (1 if i < extra else 0) for i in range(size)]
            start = sum(counts[:rank])
            expect(close(got, full[start:start + counts[rank]], dtype), f"reducescatter {case}")

    ddl.barrier()
    return failures


def check_process_sets() -> list:
    """Process sets: even/odd sets run concurrently and independently (size >= 3)."""
    rank, size = ddl.rank(), ddl.size()
    failures = []
    evens = [r for r in range(size) if r % 2 == 0]
    odds = [r for r in range(size) if r % 2 == 1]
    mine = evens if rank % 2 == 0 else odds
    # every rank passing the same bad ranks, then good ones: the set is still made
    for bad, want in ((None, "ranks is None"), ([0.5], "ints"),
                      (ddl.global_process_set, "global process set is there already")):
        try:
            ddl.add_process_set(bad)
            failures.append(f"rank {rank}: add_process_set({bad!r}) did not raise")
        except (TypeError, ValueError) as exc:
            if want not in str(exc):
                failures.append(f"rank {rank}: add_process_set({bad!r}): {exc}")
    ps = ddl.add_process_set(mine)
    if ps.process_set_id in (None, 0) or ps.size() != len(mine) or ps.rank() != mine.index(rank):
        failures.append(f"rank {rank}: bad process set {ps!r}")
    if ps.ranks != mine or ddl.global_process_set.ranks != list(range(size)):  # lists
        failures.append(f"rank {rank}: ranks {ps.ranks!r}, the global set's "
                        f"{ddl.global_process_set.ranks!r}")
    got = ddl.allreduce(np.array([rank], np.int64), name="ps/sum", op=ddl.Sum, process_set=ps)
    if int(got[0]) != sum(mine):
        failures.append(f"rank {rank}: process-set allreduce {got} != {sum(mine)}")
    xs = [make(np.float32, (5,), r, "ps-adasum") for r in range(size)]
    ada = ddl.allreduce(xs[rank], name="ps/adasum", op=ddl.Adasum, process_set=ps)
    if not close(ada, reference_adasum([xs[r] for r in mine]), np.float32):
        failures.append(f"rank {rank}: process-set adasum {ada}")
    gathered = ddl.allgather(np.array([rank]), name="ps/ag", process_set=ps)
    if list(gathered) != mine:
        failures.append(f"rank {rank}: process-set allgather {gathered}")
    b = ddl.broadcast(np.array([rank * 10]), root_rank=mine[-1], name="ps/bc", process_set=ps)
    if int(b[0]) != mine[-1] * 10:
        failures.append(f"rank {rank}: process-set broadcast {b}")
    try:
        ddl.allreduce(np.ones(1), name="ps/wrong", process_set=ddl.ProcessSet([r for r in range(size) if r not in mine]))
        failures.append(f"rank {rank}: collective on an unregistered set did not raise")
    except (ddl.DDLError, ValueError):
        pass
    ddl.remove_process_set(ps)
    ddl.barrier()
    return failures


def check_join() -> list:
    """Rank i makes i+1 allreduces, then joins: joined ranks contribute neutral values,
    Average counts only contributors, and join() returns the last rank to join."""
    rank, size = ddl.rank(), ddl.size()
    failures = []
    for k in range(rank + 1):
        contributors = list(range(k, size))
        total = ddl.allreduce(np.array([float(rank + 1)]), name=f"join/sum/{k}", op=ddl.Sum)
        mean = ddl.allreduce(np.array([float(rank + 1)]), name=f"join/avg/{k}")
        low = ddl.allreduce(np.array([rank + 1], np.int32), name=f"join/min/{k}", op=ddl.Min)
        mixed = np.array([float(rank + 1), 1.0])  # joined ranks contribute zeros
        ada = ddl.allreduce(mixed, name=f"join/adasum/{k}", op=ddl.Adasum)
        want_ada = reference_adasum([np.array([r + 1.0, 1.0]) if r >= k else np.zeros(2)
                                     for r in range(size)])
        if not close(ada, want_ada, np.float64):
            failures.append(f"rank {rank}: join step {k}: adasum {ada}, want {want_ada}")
        rows = ddl.allgather(np.full((1, 2), rank), name=f"join/ag/{k}")
        want = float(sum(r + 1 for r in contributors))
        if total[0] != want or abs(mean[0] - want / len(contributors)) > 1e-12:
            failures.append(f"rank {rank}: join step {k}: sum {total} mean {mean}, want {want}")
        if low[0] != k + 1 or rows[:, 0].tolist() != contributors:
            failures.append(f"rank {rank}: join step {k}: min {low} rows {rows.tolist()}")
    last = ddl.join()
    if last != size - 1:
        failures.append(f"rank {rank}: join() returned {last}, want {size - 1}")
    if not np.all(ddl.allreduce(np.ones(2), name="after-join", op=ddl.Sum) == size):
        failures.append(f"rank {rank}: collective after join failed")
    return failures


def reference_adasum(inputs) -> np.ndarray:
    """Adasum of ``inputs`` (rank order) in float64, written from the paper's formula: pairs
    (0,1), (2,3), ... up a binary tree, an odd one out carried up a level."""
    level = [np.asarray(x, np.float64).reshape(-1) for x in inputs]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            aa, bb, ab = a @ a, b @ b, a @ b
            if aa == 0:
                nxt.append(b)
            elif bb == 0:
                nxt.append(a)
            else:
                nxt.append((1 - ab / (2 * aa)) * a + (1 - ab / (2 * bb)) * b)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].reshape(np.shape(inputs[0]))


def check_adasum() -> list:
    """op=Adasum: the tree formula per tensor (fused or not, cached or not), its
    properties, bitwise-equal results on every rank, and the dtype errors."""
    rank, size = ddl.rank(), ddl.size()
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(f"rank {rank}: adasum: {what}")

    def same_everywhere(got, what):
        rows = ddl.allgather(np.ascontiguousarray(got).reshape(1, -1).view(np.uint8),
                             name=f"adasum/bits/{what}")
        expect(all(np.array_equal(row, rows[rank]) for row in rows),
               f"{what}: results differ across ranks")

    for dtype in (np.float16, BF16, np.float32, np.float64):
        for shape in [(), (0,), (7,), (3, 5), (20000,)]:  # 20000: past the inline area
            case = ("adasum", np.dtype(dtype).name, shape)
            inputs = [make(dtype, shape, r, case) for r in range(size)]
            mine = inputs[rank].copy()
            want = reference_adasum(inputs)
            for step in range(3):  # repeats run from the response cache
                got = ddl.allreduce(mine, name=f"adasum/{np.dtype(dtype).name}/{shape}",
                                    op=ddl.Adasum)
                expect(np.array_equal(mine, inputs[rank]), f"{case} modified its input")
                expect(close(got, want, dtype), f"{case} step {step}: got {got!r}, "
                       f"want {want!r}")
            same_everywhere(got, f"{np.dtype(dtype).name}/{shape}")
            scaled = ddl.allreduce(mine, name=f"adasum/scaled/{np.dtype(dtype).name}/{shape}",
                                   op=ddl.Adasum, prescale_factor=2.0, postscale_factor=0.25)
            expect(close(scaled, reference_adasum([2.0 * np.float64(x) for x in inputs])
                         * 0.25, dtype), f"{case} prescale 2, postscale 0.25: {scaled!r}")

    # identical inputs give that input; orthogonal ones their sum (both exact)
    same = make(np.float32, (6,), 0, "adasum-same")
    expect(np.array_equal(ddl.allreduce(same, name="adasum/same", op=ddl.Adasum), same),
           "identical inputs do not give that input")
    onehot = np.zeros(size + 1, np.float32)
    onehot[rank] = rank + 1.0
    total = np.array([r + 1.0 for r in range(size)] + [0.0], np.float32)
    expect(np.array_equal(ddl.allreduce(onehot, name="adasum/orthogonal", op=ddl.Adasum),
                          total), "orthogonal inputs do not give their sum")
    # fused: one tensor identical everywhere, one orthogonal, in one call: each combines
    # on its own (one dot product over both would give neither)
    a, b = ddl.grouped_allreduce([same, onehot], name="adasum/fused", op=ddl.Adasum)
    expect(np.array_equal(a, same) and np.array_equal(b, total),
           f"fused tensors do not combine per tensor: {a}, {b}")
    xs = [make(np.float64, (5,), r, "adasum-fused-a") for r in range(size)]
    ys = [make(np.float64, (3, 2), r, "adasum-fused-b") for r in range(size)]
    fa, fb = ddl.grouped_allreduce([xs[rank], ys[rank]], name="adasum/fused2", op=ddl.Adasum)
    expect(close(fa, reference_adasum(xs), np.float64)
           and close(fb, reference_adasum(ys), np.float64), f"fused random: {fa}, {fb}")

    # floating dtypes only, allreduce only: every rank gets the leader's error
    for dtype in (np.int32, np.bool_):
        name = f"adasum/bad/{np.dtype(dtype).name}"
        try:
            ddl.allreduce(np.ones(3, dtype), name=name, op=ddl.Adasum)
            failures.append(f"rank {rank}: adasum accepted {np.dtype(dtype).name}")
        except ddl.InvalidRequestError as exc:
            want_text = (f"allreduce '{name}': rank \\d+ sent reduce op Adasum with dtype "
                         f"{np.dtype(dtype).name}; Adasum is defined on float16, bfloat16, "
                         f"float32 and float64 only: cast the tensor to a floating dtype, or "
                         f"use op=Sum or Average")
            expect(re.fullmatch(want_text, str(exc)), f"error {exc}")
    try:
        ddl.reducescatter(np.ones((size, 2), np.float32), name="adasum/rs", op=ddl.Adasum)
        failures.append(f"rank {rank}: reducescatter accepted Adasum")
    except ddl.InvalidRequestError as exc:
        expect("Adasum is defined for allreduce only" in str(exc), f"error {exc}")
    ddl.barrier()
    return failures
def _raises(failures: list, rank: int, what: str, message: str, call) -> None:
    """``call()`` must raise InvalidRequestError with exactly ``message``."""
    try:
        call()
    except ddl.InvalidRequestError as exc:
        if str(exc) != message:
            failures.append(f"rank {rank}: {what} raised {str(exc)!r}, want {message!r}")
    else:
        failures.append(f"rank {rank}: {what} did not raise")


def _join_cached_calls(rank: int, size: int, joined: list, failures: list) -> None:
    """The same names each time (a response-cache slot after the first), run by every
    rank not in ``joined`` (rank 0 or none): checked against what the others sent."""
    last = size - 1
    live = [r for r in range(size) if r not in joined]
    arange = np.arange(2 * size, dtype=np.float32).reshape(size, 2)
    ar = ddl.allreduce(np.array([rank + 1.0]), name="jo/c/ar", op=ddl.Sum)
    bc = ddl.broadcast(np.array([rank + 1.0]), root_rank=last, name="jo/c/bc")
    rs = ddl.reducescatter(arange + rank, name="jo/c/rs", op=ddl.Sum)
    got, got_splits = ddl.alltoall(np.full((size - 1, 2), rank, np.float32),
                                   splits=[0] + [1] * (size - 1), name="jo/c/a2a")
    want_rows = [] if rank == 0 else live
    if (ar.tolist() != [float(sum(r + 1 for r in live))] or bc.tolist() != [last + 1.0]
            or not np.array_equal(rs, (len(live) * arange + sum(live))[rank:rank + 1])
            or got[:, 0].tolist() != want_rows
            or got_splits.tolist() != [int(r in want_rows) for r in range(size)]):
        failures.append(f"rank {rank}: cached calls with ranks {joined} joined: allreduce "
                        f"{ar}, broadcast {bc}, reducescatter {rs.tolist()}, alltoall "
                        f"{got.tolist()} {got_splits.tolist()}")


def check_join_ops() -> list:
    """Rank 0 joins first; the others run every collective without it (size >= 3):
    reductions get its neutral values (Average counts the others), allgathers none of its
    rows, alltoalls send it no rows, broadcasts from others reach the rest, on the global
    set and on a set holding rank 0; a broadcast from rank 0, and an alltoall that sends
    it rows, fail on every rank waiting, with the same message. Cached calls stay right
    across the join (the join flushes the cache). Then join(process_set=...), and a
    second global round. join() returns the last rank to join every time."""
    rank, size = ddl.rank(), ddl.size()
    if size < 3:
        return []
    failures: list = []
    last, live = size - 1, list(range(1, size))
    pair = ddl.add_process_set([0, last]) if rank in (0, last) else None
    for _ in range(2):
        _join_cached_calls(rank, size, [], failures)
    if rank == 0:
        got = ddl.join()
        if got != last:
            failures.append(f"rank 0: join() returned {got}, want {last}")
    else:
        _join_cached_calls(rank, size, [0], failures)
        _join_ops_without_rank_0(rank, size, pair, failures)
        if rank == last:  # completes once every other rank has joined
            ddl.allreduce(np.ones(1), name="jo/last", op=ddl.Sum)
        got = ddl.join()
        if got != last:
            failures.append(f"rank {rank}: join() returned {got}, want {last}")
    # join on a process set: rank 0 joins the pair, rank `last` runs collectives alone
    if rank == 0:
        got = ddl.join(process_set=pair)
        if got != last:
            failures.append(f"rank 0: join(process_set) returned {got}, want {last}")
    elif rank == last:
        s = ddl.allreduce(np.array([7.0]), name="jo/ps/alone", op=ddl.Sum, process_set=pair)
        r = ddl.reducescatter(np.arange(4.0).reshape(2, 2), name="jo/ps/alone-rs",
                              op=ddl.Average, process_set=pair)
        if s.tolist() != [7.0] or r.tolist() != [[2.0, 3.0]]:
            failures.append(f"rank {rank}: set with rank 0 joined: allreduce {s}, "
                            f"reducescatter {r}")
        got = ddl.join(process_set=pair)
        if got != last:
            failures.append(f"rank {rank}: join(process_set) returned {got}, want {last}")
    if pair is not None:
        ddl.remove_process_set(pair)
    # a second global round
    if rank == last:
        ddl.allreduce(np.ones(1), name="jo/last2", op=ddl.Sum)
    got = ddl.join()
    if got != last:
        failures.append(f"rank {rank}: second join() returned {got}, want {last}")
    _join_cached_calls(rank, size, [], failures)
    return failures


def _join_ops_without_rank_0(rank: int, size: int, pair, failures: list) -> None:
    """Every collective among ranks 1.. while rank 0 has joined (see check_join_ops)."""
    last, live = size - 1, list(range(1, size))
    me = rank
    # reducescatter, Average over the contributors, dim 0 split among all members
    x = make(np.float64, (size + 1, 3), rank, "jo/rs")
    want = sum(make(np.float64, (size + 1, 3), r, "jo/rs") for r in live) / len(live)
    rows = [(size + 1) // size + (1 if i < (size + 1) % size else 0) for i in range(size)]
    start = sum(rows[:me])
    got = ddl.reducescatter(x, name="jo/rs", op=ddl.Average)
    if got.shape != (rows[me], 3) or not np.allclose(got, want[start:start + rows[me]],
                                                      rtol=0, atol=1e-12):
        failures.append(f"rank {rank}: reducescatter Average with rank 0 joined: {got}")
    ints = [np.full((size, 2), rank + 1, np.int32), np.full((2 * size,), rank + 1.0)]
    got = ddl.grouped_reducescatter(ints, name="jo/grs", op=ddl.Sum)
    total = sum(r + 1 for r in live)
    if (got[0].tolist() != [[total, total]]
            or got[1].tolist() != [float(total)] * 2):
        failures.append(f"rank {rank}: grouped_reducescatter with rank 0 joined: {got}")
    # reductions: neutral values of Min and Product
    low, prod = ddl.grouped_allreduce([np.array([rank + 1], np.int32)], name="jo/gmin",
                                      op=ddl.Min) + ddl.grouped_allreduce(
        [np.array([rank + 1.0])], name="jo/gprod", op=ddl.Product)
    if low.tolist() != [2] or prod.tolist() != [float(np.prod([r + 1 for r in live]))]:
        failures.append(f"rank {rank}: Min {low}, Product {prod} with rank 0 joined")
    # allgather: no rows from rank 0
    ga, gb = ddl.grouped_allgather([np.full((rank, 2), rank), np.array([rank])],
                                   name="jo/gag")
    if ga[:, 0].tolist() != [r for r in live for _ in range(r)] or gb.tolist() != live:
        failures.append(f"rank {rank}: grouped_allgather with rank 0 joined: {ga} {gb}")
    # broadcast from a live rank reaches the others; from rank 0 it fails everywhere
    b = ddl.broadcast(np.array([rank * 10]), root_rank=1, name="jo/bc")
    if b.tolist() != [10]:
        failures.append(f"rank {rank}: broadcast with rank 0 joined: {b}")
    _raises(failures, rank, "broadcast from joined rank 0", (
        f"broadcast 'jo/bc0': root rank 0 has joined (called ddl.join) and sends nothing; "
        f"ranks {live} of process set 0 were waiting for it. To fix this, broadcast from "
        f"a rank that has not joined, or before the root calls join"),
        lambda: ddl.broadcast(np.zeros(2), root_rank=0, name="jo/bc0"))
    # alltoall: rows to rank 0 are refused, none come from it
    _raises(failures, rank, "alltoall sending rows to joined rank 0", (
        f"alltoall 'jo/a2a0': rank 1 sent 1 rows (splits {[1] * size}) to rank 0, which "
        f"has joined (called ddl.join) and receives nothing; joined ranks: [0]. To fix "
        f"this, pass splits with 0 rows for each joined rank"),
        lambda: ddl.alltoall(np.zeros((size, 1)), name="jo/a2a0"))
    splits = [0] + live  # j rows to rank j
    got, got_splits = ddl.alltoall(np.full((sum(splits), 1), rank), splits=splits,
                                   name="jo/a2a")
    if got[:, 0].tolist() != [r for r in live for _ in range(me)] or (
            got_splits.tolist() != [0] + [me] * len(live)):
        failures.append(f"rank {rank}: alltoall with rank 0 joined: {got.tolist()} "
                        f"{got_splits.tolist()}")
    ddl.barrier()  # rank 0 counts as arrived
    if rank != last:
        return
    # a process set holding rank 0 (joined globally) and this rank
    s = ddl.allreduce(np.array([3.0]), name="jo/ps/ar", process_set=pair)  # Average of one
    b = ddl.broadcast(np.array([5]), root_rank=last, name="jo/ps/bc", process_set=pair)
    r = ddl.reducescatter(np.array([[1], [2]]), name="jo/ps/rs", op=ddl.Sum, process_set=pair)
    g = ddl.allgather(np.array([last]), name="jo/ps/ag", process_set=pair)
    if s.tolist() != [3.0] or b.tolist() != [5] or r.tolist() != [[2]] or g.tolist() != [last]:
        failures.append(f"rank {rank}: set {pair!r} with rank 0 joined: allreduce {s}, "
                        f"broadcast {b}, reducescatter {r}, allgather {g}")
    _raises(failures, rank, "broadcast from joined rank 0 in a set", (
        f"broadcast 'jo/ps/bc0': root rank 0 has joined (called ddl.join) and sends "
        f"nothing; ranks [{last}] of process set {pair.process_set_id} were waiting for it. "
        f"To fix this, broadcast from a rank that has not joined, or before the root calls "
        f"join"), lambda: ddl.broadcast(np.zeros(1), root_rank=0, name="jo/ps/bc0",
                                        process_set=pair))
