"""The collective contract, run inside every rank of a world over every array library
that imports (tests/arrayimpl.py); see tests/test_contract.py for the worlds.

For each library, collective (allreduce with every reduce op, allgather with uneven first
dimensions, broadcast from every root, alltoall with uneven splits, reducescatter with
the reduce ops in turn, grouped allreduce), dtype the library supports and size (0, 1, 7
and :data:`BIG`, which spans several TCP chunks and fusion buffers at the worlds'
settings, plus one allreduce of :data:`HUGE` elements, several shared-memory rounds;
at 0 and BIG each dtype takes one reduce op and one root, in turn, see :func:`_pick`):
the result equals the NumPy
reference (bit for bit, or within the rounding bound of ``_random_checks``), has the
input's type, dtype and device, and the input is unchanged. Each rank recomputes every
member's input (``_checks.make``, seeded by rank and case) and returns failure strings.

:func:`check_backends` first asserts which backend carries each collective, so that a
world cannot silently run on another path; :func:`check_mismatches` asserts that a dtype
and a shape mismatch across ranks raise :class:`ddl.MismatchError` on every member.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

import ddl
import arrayimpl
import _checks
import _random_checks as _rc

BIG = 40_003      # elements: > DDL_TCP_CHUNK_BYTES and DDL_FUSION_THRESHOLD of the worlds
HUGE = 1_000_003  # float32 elements: several 1 MiB shared-memory slots per rank
SIZES = (0, 1, 7, BIG)
OPS = [ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product]
# the worlds' settings (tests/test_contract.py): small chunks so BIG spans several
ENV = {"DDL_TCP_CHUNK_BYTES": "16384", "DDL_FUSION_THRESHOLD": "65536",
       "PYTHONWARNINGS": "error::RuntimeWarning"}
KINDS = {"allreduce": "ALLREDUCE", "allgather": "ALLGATHER", "broadcast": "BROADCAST",
         "alltoall": "ALLTOALL", "reducescatter": "REDUCESCATTER"}


def _ops(dtype: np.dtype) -> list:
    return [ddl.Min, ddl.Max] if dtype.kind == "b" else OPS


def _pick(options: list, sizes, size: int, turn: int) -> list:
    """All ``options`` (reduce ops, roots) at sizes 1 and 7; at 0 and BIG, where the
    per-call cost buys little, one, turning with ``turn`` (the dtype's index), so that
    every option still meets every size across the dtypes."""
    if size in (1, 7):
        return options
    return [options[(turn + list(sizes).index(size)) % len(options)]]


class _Ctx:
    """One library on one process set: members, this rank's place, failure list."""

    def __init__(self, impl: arrayimpl.ArrayImpl, ps, tag: str):
        self.impl, self.ps, self.api = impl, ps, impl.api()
        self.members: List[int] = list(ps.ranks) if ps.ranks is not None else list(
            range(ddl.size()))
        self.me = ps.rank()
        self.n = len(self.members)
        self.tag = f"{tag}{impl.name}"
        self.failures: List[str] = []

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"rank {ddl.rank()}: {self.tag} {what}: {why[:500]}")

    def inputs(self, dtype, shapes: Sequence[tuple], case, positive=False) -> list:
        """Every member's NumPy input (``shapes[k]``: member k's shape)."""
        return [_checks.make(dtype, shapes[k], r, case, positive)
                for k, r in enumerate(self.members)]

    def call(self, what: str, fn: Callable[[], Any]):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any error is a failure here
            self.fail(what, f"raised {type(exc).__name__}: {exc}")
            return None

    def result(self, what: str, got, x, x_np: np.ndarray, want: np.ndarray,
               tol: Optional[np.ndarray] = None) -> None:
        """``got`` is ``want`` (within ``tol``), of ``x``'s type and device; ``x`` is
        unchanged."""
        impl = self.impl
        if not impl.is_native(got):
            self.fail(what, f"result is a {type(got).__module__}.{type(got).__name__}")
        elif impl.device(got) != impl.device(x):
            self.fail(what, f"result on {impl.device(got)}, input on {impl.device(x)}")
        else:
            why = _rc.matches_reduction(impl.to_numpy(got), want, tol, x_np.dtype)
            if why:
                self.fail(what, why)
        why = _rc.same_bits(impl.to_numpy(x), x_np)
        if why:
            self.fail(what, f"input changed: {why}")


def check_backends(expect: Dict[str, str], ps=None, nbytes: int = 4 * BIG) -> list:
    """Each collective kind of ``expect`` ("allreduce": "shm", ...) is carried by the
    backend of that name among ``ps``'s members (the global set by default)."""
    from ddl.dataplane.transports.base import Group
    from ddl.runtime import runtime as _runtime
    from ddl.v1 import coordinator_pb2 as pb
    ps = ps if ps is not None else ddl.global_process_set
    if not ps.included():
        return []
    members = list(ps.ranks) if ps.ranks is not None else list(range(ddl.size()))
    group = Group.of(members, ddl.rank())
    out = []
    for kind, want in expect.items():
        for size in (1, nbytes):
            got = _runtime.runtime().backends.pick(getattr(pb, KINDS[kind]), group, size).name
            if got != want:
                out.append(f"rank {ddl.rank()}: {kind} of {size} bytes among {members} runs "
                           f"on {got}, want {want}")
    return out


def _allreduce(c: _Ctx, sizes) -> None:
    for i, dtype in enumerate(c.impl.dtypes):
        for size in sizes:
            for op in _pick(_ops(dtype), sizes, size, i):
                case = ("ar", dtype.name, size, int(op))
                inputs = c.inputs(dtype, [(size,)] * c.n, case, op == ddl.Product)
                want, tol = _rc.expected_reduction(inputs, op, dtype, 1.0, 1.0)
                x = c.impl.from_numpy(inputs[c.me])
                what = f"allreduce {dtype.name}[{size}] {op.name}"
                got = c.call(what, lambda: c.api.allreduce(
                    x, name=f"c/{c.tag}/ar/{dtype.name}/{size}/{op.name}", op=op,
                    process_set=c.ps))
                if got is not None:
                    c.result(what, got, x, inputs[c.me], want, tol)


def _huge(c: _Ctx) -> None:
    dtype = np.dtype(np.float32)
    inputs = c.inputs(dtype, [(HUGE,)] * c.n, ("huge",))
    want, tol = _rc.expected_reduction(inputs, ddl.Sum, dtype, 1.0, 1.0)
    x = c.impl.from_numpy(inputs[c.me])
    got = c.call("huge allreduce", lambda: c.api.allreduce(
        x, name=f"c/{c.tag}/huge", op=ddl.Sum, process_set=c.ps))
    if got is not None:
        c.result(f"allreduce float32[{HUGE}] Sum", got, x, inputs[c.me], want, tol)


def _grouped(c: _Ctx, sizes) -> None:
    for i, dtype in enumerate(c.impl.dtypes):
        ops = _ops(dtype)
        op = ops[i % len(ops)]
        per = [c.inputs(dtype, [(size,)] * c.n, ("gr", dtype.name, size, int(op)),
                        op == ddl.Product) for size in sizes]
        xs = [c.impl.from_numpy(inputs[c.me]) for inputs in per]
        what = f"grouped allreduce {dtype.name}{list(sizes)} {op.name}"
        got = c.call(what, lambda: c.api.grouped_allreduce(
            xs, name=f"c/{c.tag}/gr/{dtype.name}", op=op, process_set=c.ps))
        if got is None:
            continue
        if len(got) != len(xs):
            c.fail(what, f"{len(got)} results for {len(xs)} tensors")
            continue
        for g, x, inputs, size in zip(got, xs, per, sizes):
            want, tol = _rc.expected_reduction(inputs, op, dtype, 1.0, 1.0)
            c.result(f"{what} [{size}]", g, x, inputs[c.me], want, tol)


def _rows(size: int, k: int) -> int:
    """Member k's first dimension for ``size``: uneven, zero on odd members for 1."""
    return size if k % 2 == 0 else size // 2


def _allgather(c: _Ctx, sizes) -> None:
    for dtype in c.impl.dtypes:
        for size in sizes:
            shapes = [(_rows(size, k), 3) for k in range(c.n)]
            inputs = c.inputs(dtype, shapes, ("ag", dtype.name, size))
            x = c.impl.from_numpy(inputs[c.me])
            what = f"allgather {dtype.name} rows {[s[0] for s in shapes]}"
            got = c.call(what, lambda: c.api.allgather(
                x, name=f"c/{c.tag}/ag/{dtype.name}/{size}", process_set=c.ps))
            if got is not None:
                c.result(what, got, x, inputs[c.me], np.concatenate(inputs, axis=0))


def _broadcast(c: _Ctx, sizes) -> None:
    for i, dtype in enumerate(c.impl.dtypes):
        for size in sizes:
            for root_k in _pick(list(range(c.n)), sizes, size, i):
                root = c.members[root_k]
                case = ("bc", root, dtype.name, size)
                inputs = c.inputs(dtype, [(size,)] * c.n, case)
                x = c.impl.from_numpy(inputs[c.me])
                what = f"broadcast {dtype.name}[{size}] from {root}"
                got = c.call(what, lambda: c.api.broadcast(
                    x, root_rank=root, name=f"c/{c.tag}/bc/{root}/{dtype.name}/{size}",
                    process_set=c.ps))
                if got is not None:
                    c.result(what, got, x, inputs[c.me], inputs[root_k])


def _alltoall(c: _Ctx, sizes) -> None:
    for dtype in c.impl.dtypes:
        for size in sizes:
            unit = size if size < BIG else BIG // (2 * c.n)
            # splits[k][j]: rows member k sends member j (zeros included)
            splits = [[unit * ((k + 2 * j) % 3) // 2 for j in range(c.n)]
                      for k in range(c.n)]
            inputs = c.inputs(dtype, [(sum(s), 2) for s in splits], ("a2a", dtype.name, size))
            x = c.impl.from_numpy(inputs[c.me])
            what = f"alltoall {dtype.name} splits {splits}"
            got = c.call(what, lambda: c.api.alltoall(
                x, splits=splits[c.me], name=f"c/{c.tag}/a2a/{dtype.name}/{size}",
                process_set=c.ps))
            if got is None:
                continue
            recv, rsplits = got
            want = np.concatenate([inputs[k][sum(splits[k][:c.me]):
                                             sum(splits[k][:c.me + 1])] for k in range(c.n)])
            c.result(what, recv, x, inputs[c.me], want)
            want_splits = [splits[k][c.me] for k in range(c.n)]
            if c.impl.splits(rsplits) != want_splits:
                c.fail(what, f"received splits {rsplits}, want {want_splits}")


def _reducescatter(c: _Ctx, sizes) -> None:
    for i, dtype in enumerate(c.impl.dtypes):
        ops = _ops(dtype)
        for s, size in enumerate(sizes):
            op = ops[(i + s) % len(ops)]
            rows = size if size < BIG else BIG // 3
            inputs = c.inputs(dtype, [(rows, 3)] * c.n, ("rs", dtype.name, size, int(op)),
                              op == ddl.Product)
            want, tol = _rc.expected_reduction(inputs, op, dtype, 1.0, 1.0)
            start, stop = _rc.row_blocks(rows, c.n)[c.me]
            x = c.impl.from_numpy(inputs[c.me])
            what = f"reducescatter {dtype.name}[{rows}, 3] {op.name}"
            got = c.call(what, lambda: c.api.reducescatter(
                x, name=f"c/{c.tag}/rs/{dtype.name}/{size}", op=op, process_set=c.ps))
            if got is not None:
                c.result(what, got, x, inputs[c.me], want[start:stop],
                         None if tol is None else tol[start:stop])


def check_library(impl: arrayimpl.ArrayImpl, ps=None, tag: str = "",
                  sizes: Sequence[int] = SIZES) -> list:
    """Every collective x dtype x size of the contract (module doc) for ``impl``'s arrays
    among ``ps``'s members (the global set by default)."""
    ps = ps if ps is not None else ddl.global_process_set
    if not ps.included():
        return []
    c = _Ctx(impl, ps, tag)
    for part in (_allreduce, _grouped, _allgather, _broadcast, _alltoall, _reducescatter):
        part(c, sizes)
    if BIG in sizes:
        _huge(c)
    return c.failures


def _expect_mismatch(c: _Ctx, what: str, fn: Callable[[], Any], needle: str) -> None:
    try:
        fn()
    except ddl.MismatchError as exc:
        if needle not in str(exc):
            c.fail(what, f"MismatchError without {needle!r}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - the wrong error is a failure
        c.fail(what, f"raised {type(exc).__name__}, not MismatchError: {exc}")
        return
    c.fail(what, "nothing was raised")


def check_mismatches(impl: arrayimpl.ArrayImpl, ps=None, tag: str = "") -> list:
    """A dtype and a shape mismatch (the last member differs) raise MismatchError naming
    both ranks on every member, for ``impl``'s arrays; the set stays usable."""
    ps = ps if ps is not None else ddl.global_process_set
    if not ps.included():
        return []
    c = _Ctx(impl, ps, tag)
    last, first = c.members[-1], c.members[0]
    odd = c.me == c.n - 1
    x = c.impl.from_numpy(np.zeros(3, np.int32 if odd else np.float32))
    _expect_mismatch(c, "dtype mismatch", lambda: c.api.allreduce(
        x, name=f"c/{c.tag}/bad/dtype", op=ddl.Sum, process_set=ps),
        f"dtype mismatch: rank {first} sent float32[3], rank {last} sent int32[3]")
    y = c.impl.from_numpy(np.zeros((2, 4 if odd else 3), np.float32))
    _expect_mismatch(c, "shape mismatch", lambda: c.api.allgather(
        y, name=f"c/{c.tag}/bad/shape", process_set=ps), "shape mismatch")
    ok = c.impl.from_numpy(np.ones(2, np.float32))
    got = c.call("a call after the mismatches", lambda: c.api.allreduce(
        ok, name=f"c/{c.tag}/bad/after", op=ddl.Sum, process_set=ps))
    if got is not None:
        c.result("a call after the mismatches", got, ok, np.ones(2, np.float32),
                 np.full(2, c.n, np.float32))
    return c.failures


def run_world(expect: Dict[str, str], subset: Optional[List[int]] = None,
              subset_expect: Optional[Dict[str, str]] = None,
              libs: Optional[List[str]] = None,
              extra: Callable[[List[str]], Sequence[Callable[[], list]]] = lambda _: ()
              ) -> dict:
    """The whole contract in this rank: backends, every library on the global set and on
    ``subset`` (a process set, with the smaller sizes), mismatches on both, then the
    checks that ``extra(names of the libraries that ran)`` returns. Returns
    ``{"failures", "ran", "skipped", "seconds"}`` (seconds per part, for the report of a
    slow world)."""
    seconds: Dict[str, float] = {}
    clock = [time.monotonic()]

    def lap(part: str) -> None:
        now = time.monotonic()
        seconds[part] = round(now - clock[0], 2)
        clock[0] = now

    impls, skipped = arrayimpl.available(libs)
    lap("import")
    failures = check_backends(expect)
    for impl in impls:
        failures += check_library(impl)
        failures += check_mismatches(impl)
        lap(impl.name)
    if subset is not None:
        if ddl.rank() in subset:  # only members add a set
            ps = ddl.add_process_set(subset)
            failures += check_backends(subset_expect or {}, ps)
            for impl in impls:
                failures += check_library(impl, ps, tag="ps/", sizes=(0, 1, 7))
                failures += check_mismatches(impl, ps, tag="ps/")
            ddl.remove_process_set(ps)
        ddl.barrier()
        lap("subset")
    for fn in extra([i.name for i in impls]):
        failures += fn()
        lap(f"{fn.__module__}.{fn.__name__}")
    return {"failures": failures, "ran": [i.name for i in impls], "skipped": skipped,
            "seconds": seconds}
