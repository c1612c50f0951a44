"""Randomized collectives checked against NumPy; runs inside every rank of a test world.

:func:`plan` turns ``(seed, world, count)`` into a list of :class:`Case` objects. It is a
pure function: every rank (and the test process) derives the same list. Each case names
its collective, dtype(s), shape(s), reduce op, scale factors, root, splits, the members
taking part (the whole world or a process set), and whether it is submitted
synchronously or as an ``_async`` call waited later, out of order.

:func:`run_cases` executes the plan on one rank. Inputs come from ``_checks.make``,
seeded by (seed, case index, tensor number) and rank, so every rank recomputes every other
rank's input and checks its own result against NumPy: bit for bit for the data-movement
ops, integers and bools; for floating-point reductions within a rigorous rounding bound
(the library accumulates in the dtype itself, float32 for bfloat16, in a ring order
NumPy does not reproduce).

Sizes straddle the library's algorithm switches: ``DDL_SMALL_MESSAGE_BYTES`` (64 KiB:
recursive doubling below, ring above), ``DDL_TCP_CHUNK_BYTES`` (1 MiB: ring pipelining
chunk; twice that switches broadcast to a chained pipeline), their multiples by the world
size, plus 0, 1 and world +- 1 elements and, rarely, up to 4 Mi elements.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

import ddl
import _checks

SMALL_MESSAGE_BYTES = 1 << 16  # DDL_SMALL_MESSAGE_BYTES default
CHUNK_BYTES = 1 << 20          # DDL_TCP_CHUNK_BYTES default
MAX_ELEMENTS = 4 << 20         # the largest tensor a case may have
BIG_ELEMENTS = 200_000         # "big": counts against a per-world budget
BIG_PER_PERIOD = 12            # big cases per BUDGET_PERIOD cases of a world
HUGE_PER_PERIOD = 2            # cases of 1-4 Mi elements per BUDGET_PERIOD cases
BUDGET_PERIOD = 200            # the default count gives each world one period
ASYNC_MAX_ELEMENTS = 1 << 16   # async cases stay small: they are held until waited

KINDS = ["allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
         "reducescatter"]
KIND_WEIGHTS = [0.32, 0.10, 0.15, 0.15, 0.13, 0.15]
DTYPES = [np.dtype(d) for d in _checks.DTYPES]
BOOL_OPS = [ddl.Min, ddl.Max]  # the only reductions defined on bool
# Scale factors (0.0 included: it must zero the result, not read as "unset").
# Integer factors are kept small so that no scaled value overflows its dtype (a
# float -> int cast out of range is undefined), which keeps the reference exact.
FLOAT_FACTORS = [1.0, 0.5, 2.0, 0.25, 1.5, 3.0, 0.1, 0.37, -1.0, -0.5, 0.0]
SIGNED_FACTORS = [1.0, 0.5, 0.25, 1.5, 0.3, 0.7, -1.0, -0.5, 0.0]
UNSIGNED_FACTORS = [1.0, 0.5, 0.25, 1.5, 0.3, 0.7, 0.0]


@dataclasses.dataclass(frozen=True)
class Case:
    """One randomized collective. Shapes are per tensor (``grouped_allreduce``: several),
    or, for ``allgather`` and ``alltoall``, per member (dim 0 differs)."""

    index: int
    kind: str
    members: Tuple[int, ...]
    use_set: bool
    dtypes: Tuple[np.dtype, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    op: Optional[ddl.ReduceOp] = None
    pre: float = 1.0
    post: float = 1.0
    root: int = -1
    splits: Optional[Tuple[Tuple[int, ...], ...]] = None  # alltoall, per member
    mode: str = "sync"      # "sync" or "async"
    layout: str = "c"       # "c", "fortran" or "strided" input
    flush_at: int = 1       # async: wait out pending handles once this many are pending

    def describe(self) -> str:
        """A one-line summary for failure messages."""
        parts = [self.kind, "/".join(d.name for d in self.dtypes),
                 "shapes=" + ",".join(str(s) for s in self.shapes)]
        if self.op is not None:
            parts.append(f"op={self.op.name}")
        if (self.pre, self.post) != (1.0, 1.0):
            parts.append(f"pre={self.pre} post={self.post}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.splits is not None:
            parts.append(f"splits={self.splits}")
        parts.append(f"members={list(self.members)}{' (set)' if self.use_set else ''}")
        parts.append(f"{self.mode} layout={self.layout}")
        return " ".join(parts)


# -- planning ------------------------------------------------------------------------------

class _Planner:
    """Draws cases from one generator seeded by (seed, world), with budgets for big sizes.

    The budgets refill every BUDGET_PERIOD cases, so a long run keeps the same mix.

    Every draw depends only on earlier draws, so the first k cases of a plan are the same
    whatever the total count (a failing case replays with a smaller count too).
    """

    def __init__(self, seed: int, world: int):
        self.rng = np.random.default_rng([seed, world])
        self.world = world
        self.big_left = self.huge_left = 0

    def pick(self, seq: Sequence[Any]) -> Any:
        return seq[int(self.rng.integers(len(seq)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def tiny_count(self) -> int:
        """0, 1, world +- 1 and other small element counts, odd ones included."""
        w = self.world
        return self.pick([0, 1, 2, max(w - 1, 0), w, w + 1, 2 * w - 1, 2 * w + 1,
                          int(self.rng.integers(3, 1000)) | 1, int(self.rng.integers(1, 5000))])

    def edge_counts(self, itemsize: int) -> List[int]:
        """Element counts within one element of the algorithm switches, for ``itemsize``."""
        edges = {SMALL_MESSAGE_BYTES, CHUNK_BYTES, 2 * CHUNK_BYTES,
                 self.world * SMALL_MESSAGE_BYTES, self.world * CHUNK_BYTES}
        out = set()
        for nbytes in edges:
            e = nbytes // itemsize
            out.update({e - 1, e, e + 1, e + self.world})
        return sorted(c for c in out if 0 < c <= MAX_ELEMENTS)

    def count(self, itemsize: int, allow_big: bool = True) -> int:
        """An element count: mostly tiny, often at an edge, rarely up to 4 Mi."""
        r = self.rng.random()
        if allow_big and r < 0.03 and self.huge_left > 0:
            self.huge_left -= 1
            return MAX_ELEMENTS if self.chance(0.5) else int(
                self.rng.integers(CHUNK_BYTES, MAX_ELEMENTS))
        if r < 0.33:
            c = self.pick(self.edge_counts(itemsize))
            if c <= BIG_ELEMENTS:
                return c
            if allow_big and self.big_left > 0:
                self.big_left -= 1
                return c
        return self.tiny_count()

    def shape(self, count: int, min_ndim: int) -> Tuple[int, ...]:
        """A random shape of ``count`` elements with ``min_ndim`` to 3 dimensions."""
        ndim = int(self.rng.integers(min_ndim, 4))
        if ndim == 0 and count != 1:
            ndim = 1
        if ndim == 0:
            return ()
        if count == 0:
            dims = [int(self.rng.integers(1, 5)) for _ in range(ndim)]
            dims[int(self.rng.integers(ndim))] = 0
            return tuple(dims)
        dims, rest = [], count
        for _ in range(ndim - 1):
            d = self.pick([d for d in range(1, 17) if rest % d == 0])
            dims.append(d)
            rest //= d
        dims.append(rest)
        return tuple(int(dims[i]) for i in self.rng.permutation(ndim))

    def partition(self, total: int, parts: int) -> Tuple[int, ...]:
        """``parts`` non-negative ints summing to ``total`` (zeros and even splits likely)."""
        if self.chance(0.3) and total % parts == 0:
            return (total // parts,) * parts
        cuts = sorted(int(c) for c in self.rng.integers(0, total + 1, size=parts - 1))
        bounds = [0] + cuts + [total]
        return tuple(bounds[k + 1] - bounds[k] for k in range(parts))

    def members(self) -> Tuple[Tuple[int, ...], bool]:
        """The whole world, or (worlds of 3+) a random process set of 1..world ranks."""
        if self.world >= 3 and self.chance(0.3):
            k = int(self.rng.integers(1, self.world + 1))
            ranks = self.rng.choice(self.world, size=k, replace=False)
            return tuple(sorted(int(r) for r in ranks)), True
        return tuple(range(self.world)), False

    def reduction(self, dtypes: Sequence[np.dtype] = ()) -> ddl.ReduceOp:
        """A reduce op valid on every dtype in ``dtypes``."""
        if any(d.kind == "b" for d in dtypes):
            return self.pick(BOOL_OPS)
        return self.pick(_checks.OPS)

    def dtype_for(self, op: ddl.ReduceOp) -> np.dtype:
        """A dtype on which ``op`` is defined."""
        return self.pick([d for d in DTYPES if d.kind != "b" or op in BOOL_OPS])

    def scales(self, dtypes: Sequence[np.dtype], op: ddl.ReduceOp) -> Tuple[float, float]:
        """(prescale, postscale): 1.0 mostly; never on bool or integer Product."""
        ints = [d for d in dtypes if d.kind in "iu"]
        if any(d.kind == "b" for d in dtypes) or (ints and op == ddl.Product):
            return 1.0, 1.0
        if not self.chance(0.35):
            return 1.0, 1.0
        if any(d.kind == "u" for d in ints):
            factors = UNSIGNED_FACTORS
        elif ints:
            factors = SIGNED_FACTORS
        else:
            factors = FLOAT_FACTORS
        return float(self.pick(factors)), float(self.pick(factors))

    def layout(self, shape: Tuple[int, ...]) -> str:
        """How the input is laid out in memory: C order mostly, else Fortran or strided."""
        r = self.rng.random()
        if r < 0.1 and len(shape) >= 2:
            return "fortran"
        if r < 0.2 and len(shape) >= 1:
            return "strided"
        return "c"

    def case(self, index: int) -> Case:
        """Draw case ``index``: kind first, then members, then its own parameters."""
        if index % BUDGET_PERIOD == 0:
            self.big_left, self.huge_left = BIG_PER_PERIOD, HUGE_PER_PERIOD
        kind = str(self.rng.choice(KINDS, p=KIND_WEIGHTS))
        members, use_set = self.members()
        fields = getattr(self, "_" + kind)(len(members), members)
        case = Case(index=index, kind=kind, members=members, use_set=use_set, **fields)
        elements = sum(int(np.prod(s, dtype=np.int64)) for s in case.shapes)
        if elements <= ASYNC_MAX_ELEMENTS and self.chance(0.3):
            case = dataclasses.replace(case, mode="async",
                                       flush_at=int(self.rng.integers(1, 7)))
        return case

    def _allreduce(self, m: int, members) -> dict:
        dtype = self.pick(DTYPES)
        op = self.reduction([dtype])
        itemsize = 4 if dtype == _checks.BF16 else dtype.itemsize  # reduced in float32
        shape = self.shape(self.count(itemsize), 0)
        pre, post = self.scales([dtype], op)
        return dict(dtypes=(dtype,), shapes=(shape,), op=op, pre=pre, post=post,
                    layout=self.layout(shape))

    def _grouped_allreduce(self, m: int, members) -> dict:
        op = self.pick(_checks.OPS)
        k = int(self.rng.integers(1, 5))
        if self.chance(0.5):  # one dtype: the tensors share a fused buffer
            dtypes = (self.dtype_for(op),) * k
        else:
            dtypes = tuple(self.dtype_for(op) for _ in range(k))
        shapes = tuple(self.shape(self.count(d.itemsize, allow_big=False), 0) for d in dtypes)
        pre, post = self.scales(dtypes, op)
        return dict(dtypes=dtypes, shapes=shapes, op=op, pre=pre, post=post)

    def _allgather(self, m: int, members) -> dict:
        dtype = self.pick(DTYPES)
        rows, *tail = self.shape(self.count(dtype.itemsize), 1)
        shapes = tuple((r, *tail) for r in self.partition(rows, m))
        return dict(dtypes=(dtype,), shapes=shapes, layout=self.layout(shapes[0]))

    def _broadcast(self, m: int, members) -> dict:
        dtype = self.pick(DTYPES)
        shape = self.shape(self.count(dtype.itemsize), 0)
        return dict(dtypes=(dtype,), shapes=(shape,), root=int(self.pick(members)),
                    layout=self.layout(shape))

    def _alltoall(self, m: int, members) -> dict:
        dtype = self.pick(DTYPES)
        rows, *tail = self.shape(self.count(dtype.itemsize), 1)
        per_member = self.partition(rows, m)
        if self.chance(0.25):  # no splits: dim 0 must divide evenly
            shapes = tuple((r - r % m, *tail) for r in per_member)
            return dict(dtypes=(dtype,), shapes=shapes, splits=None)
        splits = tuple(self.partition(r, m) for r in per_member)
        shapes = tuple((r, *tail) for r in per_member)
        return dict(dtypes=(dtype,), shapes=shapes, splits=splits,
                    layout=self.layout(shapes[0]))

    def _reducescatter(self, m: int, members) -> dict:
        dtype = self.pick(DTYPES)
        op = self.reduction([dtype])
        if self.chance(0.4):
            rows = self.pick([0, 1, max(m - 1, 1), m, m + 1, 2 * m + 1])
            shape = (rows, *self.pick([(), (3,), (2, 5)]))
        else:
            itemsize = 4 if dtype == _checks.BF16 else dtype.itemsize
            shape = self.shape(self.count(itemsize), 1)
        pre, post = self.scales([dtype], op)
        return dict(dtypes=(dtype,), shapes=(shape,), op=op, pre=pre, post=post,
                    layout=self.layout(shape))


def plan(seed: int, world: int, count: int) -> List[Case]:
    """The ``count`` cases of world size ``world`` for ``seed``; the same on every rank."""
    planner = _Planner(seed, world)
    return [planner.case(i) for i in range(count)]


# -- inputs and references -----------------------------------------------------------------

def make_input(seed: int, case: Case, part: int, rank: int, dtype, shape,
               positive: bool = False) -> np.ndarray:
    """Rank ``rank``'s input number ``part`` of ``case``: the same on every rank."""
    key = ("random", int(seed), case.index, int(part))
    return _checks.make(dtype, tuple(int(d) for d in shape), int(rank), key, positive)


def lay_out(x: np.ndarray, layout: str) -> np.ndarray:
    """A copy of ``x`` with the same values in the memory layout ``layout``."""
    if layout == "fortran":
        return np.array(x, order="F", copy=True)
    if layout == "strided":
        big = np.empty((2 * x.shape[0],) + x.shape[1:], dtype=x.dtype)
        big[::2] = x
        big[1::2] = x[::-1]  # filler that must not leak into the result
        return big[::2]
    return x.copy()


def _unit_roundoff(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps) / 2


def _tiny(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal)


def _prescaled(x: np.ndarray, pre: float) -> np.ndarray:
    """``pre * x`` as the library defines it: integers truncate toward zero, clipped to
    the dtype's range."""
    if pre == 1.0:
        return x
    if x.dtype.kind in "iu":
        return _int_scaled(x, pre, x.dtype)
    return x.astype(np.float64) * pre


def _int_scaled(x: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    v = np.trunc(np.asarray(x).astype(np.float64) * factor)
    return np.clip(v, float(info.min), float(np.nextafter(float(info.max), 0.0))
                   if dtype.itemsize == 8 else float(info.max)).astype(dtype)


def expected_reduction(inputs: Sequence[np.ndarray], op, dtype, pre: float, post: float):
    """``(want, tol)``: the documented ``post * reduce(pre * x)`` of ``inputs``.

    Integers and bools: ``want`` has ``dtype`` and ``tol`` is None (exact). Floats:
    ``want`` is float64 and ``tol`` an elementwise bound on the rounding of the library's
    reduction in its reduction dtype (any order), the factors and the final cast.
    """
    dtype = np.dtype(dtype)
    n = len(inputs)
    scaled = [_prescaled(x, pre) for x in inputs]
    if dtype.kind in "biu":
        want = _checks.reference_allreduce(scaled, op, dtype)
        if post != 1.0:
            want = _int_scaled(want, post, dtype)
        return want, None
    want = _checks.reference_allreduce(scaled, op, np.float64) * post
    red = np.dtype(np.float32) if dtype == _checks.BF16 else dtype
    u_red, u_out = _unit_roundoff(red), _unit_roundoff(dtype)
    tiny = (2 * n + 6) * _tiny(red) + _tiny(dtype)
    if op in (ddl.Sum, ddl.Average):
        magnitude = sum(np.abs(x.astype(np.float64)) for x in inputs) * abs(pre * post)
        if op == ddl.Average:
            magnitude = magnitude / n
        tol = (n + 5) * u_red * magnitude + u_out * np.abs(want) + tiny
    elif op == ddl.Product:
        tol = ((2 * n + 5) * u_red + u_out) * np.abs(want) + tiny
    elif (pre, post) == (1.0, 1.0):
        tol = np.zeros(np.shape(want))  # Min/Max of unscaled values: exact
    else:
        tol = (4 * u_red + u_out) * np.abs(want) + tiny
    return want, tol


def row_blocks(rows: int, parts: int) -> List[Tuple[int, int]]:
    """(start, stop) of each member's rows: as even as possible, earlier ones get more."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


# -- comparison ----------------------------------------------------------------------------

def _header(got: Any, dtype, shape) -> Optional[str]:
    """What is wrong with ``got``'s type, dtype or shape, or None."""
    if not isinstance(got, np.ndarray):
        return f"result is {type(got).__name__}, not ndarray"
    if got.dtype != np.dtype(dtype) or got.shape != tuple(shape):
        return f"result is {got.dtype}{list(got.shape)}, want {np.dtype(dtype)}{list(shape)}"
    return None


def same_bits(got: Any, want: np.ndarray) -> Optional[str]:
    """None if ``got`` is ``want`` bit for bit (dtype and shape too), else the difference."""
    bad = _header(got, want.dtype, want.shape)
    if bad:
        return bad
    a = np.ascontiguousarray(got).reshape(-1)
    b = np.ascontiguousarray(want).reshape(-1)
    diff = np.flatnonzero(a.view(np.uint8) != b.view(np.uint8)) // max(a.itemsize, 1)
    if diff.size == 0:
        return None
    i = int(diff[0])
    return (f"{np.unique(diff).size} of {a.size} elements differ; first at flat index {i}: "
            f"got {a[i]!r}, want {b[i]!r}")


def matches_reduction(got: Any, want: np.ndarray, tol: Optional[np.ndarray], dtype) -> \
        Optional[str]:
    """None if ``got`` equals ``want`` (exactly, or within ``tol`` elementwise)."""
    if tol is None:
        return same_bits(got, np.asarray(want, dtype=dtype))
    bad = _header(got, dtype, np.shape(want))
    if bad:
        return bad
    g = got.astype(np.float64).reshape(-1)
    w = np.asarray(want, dtype=np.float64).reshape(-1)
    t = np.asarray(tol, dtype=np.float64).reshape(-1)
    off = np.flatnonzero(~(np.abs(g - w) <= t))  # NaN counts as wrong
    if off.size == 0:
        return None
    i = int(off[0])
    return (f"{off.size} of {g.size} elements outside the rounding bound; first at flat "
            f"index {i}: got {g[i]!r}, want {w[i]!r} +- {t[i]!r}")


# -- the collectives -----------------------------------------------------------------------
# Each returns (call, check): call(async_) submits the collective (the ``_async`` twin when
# async_) and returns its result or handle; check(result) returns a list of problems.

def _input_unchanged(arg: np.ndarray, original: np.ndarray) -> List[str]:
    bad = same_bits(arg, original)
    return [] if bad is None else [f"input was modified: {bad}"]


def _allreduce(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    dtype, shape = case.dtypes[0], case.shapes[0]
    positive = case.op == ddl.Product
    inputs = [make_input(ctx.seed, case, 0, r, dtype, shape, positive) for r in case.members]
    mine = inputs[case.members.index(ctx.rank)]
    arg = lay_out(mine, case.layout)
    kwargs = dict(name=ctx.name(case), op=case.op, prescale_factor=case.pre,
                  postscale_factor=case.post, process_set=ps)

    def call(async_: bool):
        return (ddl.allreduce_async if async_ else ddl.allreduce)(arg, **kwargs)

    def check(got) -> List[str]:
        want, tol = expected_reduction(inputs, case.op, dtype, case.pre, case.post)
        bad = matches_reduction(got, want, tol, dtype)
        return ([] if bad is None else [bad]) + _input_unchanged(arg, mine)

    return call, check


def _grouped_allreduce(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    positive = case.op == ddl.Product
    inputs = [[make_input(ctx.seed, case, k, r, d, s, positive) for r in case.members]
              for k, (d, s) in enumerate(zip(case.dtypes, case.shapes))]
    me = case.members.index(ctx.rank)
    args = [per_rank[me].copy() for per_rank in inputs]
    kwargs = dict(name=ctx.name(case), op=case.op, prescale_factor=case.pre,
                  postscale_factor=case.post, process_set=ps)

    def call(async_: bool):
        fn = ddl.grouped_allreduce_async if async_ else ddl.grouped_allreduce
        return fn(args, **kwargs)

    def check(got) -> List[str]:
        if not isinstance(got, list) or len(got) != len(args):
            return [f"result is {type(got).__name__} of {len(got)}, want list of {len(args)}"]
        problems = []
        for k, (per_rank, dtype) in enumerate(zip(inputs, case.dtypes)):
            want, tol = expected_reduction(per_rank, case.op, dtype, case.pre, case.post)
            bad = matches_reduction(got[k], want, tol, dtype)
            if bad:
                problems.append(f"tensor {k}: {bad}")
            problems += _input_unchanged(args[k], per_rank[me])
        return problems

    return call, check


def _allgather(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    dtype = case.dtypes[0]
    inputs = [make_input(ctx.seed, case, 0, r, dtype, s)
              for r, s in zip(case.members, case.shapes)]
    mine = inputs[case.members.index(ctx.rank)]
    arg = lay_out(mine, case.layout)

    def call(async_: bool):
        fn = ddl.allgather_async if async_ else ddl.allgather
        return fn(arg, name=ctx.name(case), process_set=ps)

    def check(got) -> List[str]:
        bad = same_bits(got, np.concatenate(inputs, axis=0))
        return ([] if bad is None else [bad]) + _input_unchanged(arg, mine)

    return call, check


def _broadcast(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    dtype, shape = case.dtypes[0], case.shapes[0]
    mine = make_input(ctx.seed, case, 0, ctx.rank, dtype, shape)
    arg = lay_out(mine, case.layout)

    def call(async_: bool):
        fn = ddl.broadcast_async if async_ else ddl.broadcast
        return fn(arg, root_rank=case.root, name=ctx.name(case), process_set=ps)

    def check(got) -> List[str]:
        want = make_input(ctx.seed, case, 0, case.root, dtype, shape)
        bad = same_bits(got, want)
        return ([] if bad is None else [bad]) + _input_unchanged(arg, mine)

    return call, check


def _alltoall(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    dtype, m = case.dtypes[0], len(case.members)
    me = case.members.index(ctx.rank)
    inputs = [make_input(ctx.seed, case, 0, r, dtype, s)
              for r, s in zip(case.members, case.shapes)]
    splits = case.splits or tuple((s[0] // m,) * m for s in case.shapes)
    arg = lay_out(inputs[me], case.layout)

    def call(async_: bool):
        fn = ddl.alltoall_async if async_ else ddl.alltoall
        given = None if case.splits is None else list(case.splits[me])
        return fn(arg, splits=given, name=ctx.name(case), process_set=ps)

    def check(got) -> List[str]:
        if not isinstance(got, tuple) or len(got) != 2:
            return [f"result is {type(got).__name__}, want (received, received_splits)"]
        received, received_splits = got
        blocks = []
        for j in range(m):
            start = sum(splits[j][:me])
            blocks.append(inputs[j][start:start + splits[j][me]])
        problems = []
        bad = same_bits(received, np.concatenate(blocks, axis=0))
        if bad:
            problems.append(bad)
        want_splits = [splits[j][me] for j in range(m)]
        if [int(s) for s in np.asarray(received_splits).reshape(-1)] != want_splits:
            problems.append(f"received_splits {received_splits!r}, want {want_splits}")
        return problems + _input_unchanged(arg, inputs[me])

    return call, check


def _reducescatter(case: Case, ctx: "_Context", ps) -> Tuple[Callable, Callable]:
    dtype, shape = case.dtypes[0], case.shapes[0]
    positive = case.op == ddl.Product
    inputs = [make_input(ctx.seed, case, 0, r, dtype, shape, positive) for r in case.members]
    me = case.members.index(ctx.rank)
    arg = lay_out(inputs[me], case.layout)

    def call(async_: bool):
        fn = ddl.reducescatter_async if async_ else ddl.reducescatter
        return fn(arg, name=ctx.name(case), op=case.op, process_set=ps,
                  prescale_factor=case.pre, postscale_factor=case.post)

    def check(got) -> List[str]:
        want, tol = expected_reduction(inputs, case.op, dtype, case.pre, case.post)
        start, stop = row_blocks(shape[0], len(case.members))[me]
        bad = matches_reduction(got, want[start:stop], None if tol is None else
                                tol[start:stop], dtype)
        return ([] if bad is None else [bad]) + _input_unchanged(arg, inputs[me])

    return call, check


COLLECTIVES = {"allreduce": _allreduce, "grouped_allreduce": _grouped_allreduce,
               "allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
               "reducescatter": _reducescatter}


# -- running -------------------------------------------------------------------------------

class _Context:
    """One rank's state while it runs a plan: process sets, pending handles, failures."""

    def __init__(self, seed: int, world: int):
        self.seed, self.world, self.rank = seed, world, ddl.rank()
        self.sets: Dict[Tuple[int, ...], ddl.ProcessSet] = {}
        self.pending: List[Tuple[Case, Any, Callable]] = []
        self.failures: List[str] = []
        self.done = 0
        self.order = np.random.default_rng([seed, world, 1 + self.rank])

    def name(self, case: Case) -> str:
        return f"rand/{case.index}/{case.kind}"

    def fail(self, case: Case, what: str) -> None:
        self.failures.append(f"seed={self.seed} world={self.world} case={case.index} "
                             f"rank={self.rank}: {case.describe()}: {what}")

    def process_set(self, case: Case):
        """The set ``case`` runs on; the first case on a new set registers it (members only)."""
        if not case.use_set:
            return ddl.global_process_set
        if case.members not in self.sets:
            self.sets[case.members] = ddl.add_process_set(list(case.members))
        return self.sets[case.members]

    def finish(self, case: Case, result: Any, check: Callable) -> None:
        self.done += 1
        for problem in check(result):
            self.fail(case, problem)

    def flush(self) -> None:
        """Wait out every pending handle, in a random order (not submission order)."""
        pending, self.pending = self.pending, []
        for k in self.order.permutation(len(pending)):
            case, handle, check = pending[int(k)]
            try:
                self.finish(case, ddl.synchronize(handle), check)
            except ddl.FatalError:
                raise
            except Exception as exc:  # a wrong-result report must not stop the run
                self.fail(case, f"raised {type(exc).__name__}: {exc}")

    def run(self, case: Case) -> None:
        """Submit one case this rank is a member of; check it now, or later if async."""
        try:
            call, check = COLLECTIVES[case.kind](case, self, self.process_set(case))
            if case.mode == "async":
                self.pending.append((case, call(True), check))
                if len(self.pending) >= case.flush_at:
                    self.flush()
            else:
                self.finish(case, call(False), check)
        except ddl.FatalError:
            raise
        except Exception as exc:
            self.fail(case, f"raised {type(exc).__name__}: {exc}")


def run_cases(seed: int, world: int, count: int) -> Dict[str, Any]:
    """Run the plan of (seed, world, count) on this rank.

    Returns ``{"failures": [...], "done": n}``: one line per wrong result or error, and how
    many cases this rank completed (the cases it is a member of).
    """
    ctx = _Context(seed, world)
    try:
        for case in plan(seed, world, count):
            if ctx.rank in case.members:
                ctx.run(case)
        ctx.flush()
        for members in sorted(ctx.sets):
            if ctx.sets[members].process_set_id != 0:  # a set of all ranks is the global one
                ddl.remove_process_set(ctx.sets[members])
        ddl.barrier()
    except ddl.FatalError as exc:
        ctx.failures.append(f"seed={seed} world={world} rank={ctx.rank}: fatal "
                            f"{type(exc).__name__}: {exc}")
    return {"failures": ctx.failures, "done": ctx.done}
