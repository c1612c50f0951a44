"""The reduction contract at the edges of every dtype, run inside every rank of a world
(see test_reduction_contract.py).

Every dtype x op gets columns of edge values (the dtype's max and min, values whose sum
overflows, mixed signs, and for floats -0.0, inf and nan), checked against an exact
reference of the documented contract (README "Reductions", ``ddl.ReduceOp``):

* integer Sum and Product wrap around modulo 2**bits; Min and Max are exact;
* integer Average is the exact mean of the contributors, truncated toward zero;
* floating Sum and Product saturate to +-inf; floating Average does not overflow when
  the inputs are finite (each input is scaled by 1/n before the sum) and not within
  about n ulps of the largest value (where a rounding may: the Average columns use the
  largest value less 2n ulps); inf and nan propagate as IEEE says. Floats are compared
  within FLOAT_RTOL + n ulps of the dtype.

Each case runs on several paths: a plain call, a fused call (grouped with another
tensor), the same calls repeated so that they run from the response cache (small ones
inline in the cache's shared-memory round, large ones as collectives, two at once
fused), and reducescatter (plain and cached). Calls that fail (for example a NumPy
RuntimeWarning turned into an error by ``PYTHONWARNINGS=error::RuntimeWarning``) are
failures too.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List

import ml_dtypes
import numpy as np

import ddl

BF16 = np.dtype(ml_dtypes.bfloat16)
INT_DTYPES = [np.dtype(d) for d in (np.uint8, np.int8, np.uint16, np.int16, np.int32,
                                    np.int64)]
FLOAT_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
OPS = [ddl.Sum, ddl.Average, ddl.Min, ddl.Max, ddl.Product]
# documented tolerance of a finite floating result: this many units of the dtype's
# precision (eps), relative; plus the world size (Average scales each input by 1/n and
# sums n rounded terms)
FLOAT_RTOL = 4
BIG_BYTES = 200 * 1024  # the "big" variant: beyond the inline area, shm's one-round size


def _float_max(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def columns(dtype: np.dtype, op, rank: int, n: int) -> list:
    """Rank ``rank``'s edge values (Python numbers) for ``dtype`` and ``op``."""
    if dtype.kind == "b":
        return [True, False, rank % 2 == 0, rank != n - 1, True, False, rank == 0, False]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
        signed = dtype.kind == "i"
        return [hi, lo, hi if rank % 2 == 0 else lo, hi - rank, lo + rank,
                ((-1) ** rank) * (rank + 1) if signed else rank + 1, 0, hi // 2 + 1 + rank,
                hi - 1 if rank == 0 else 2, (lo + 1) if signed and rank == 1 else -1 if signed
                else 3]
    big = _float_max(dtype)
    if op == ddl.Average:  # the documented limit: not within about n ulps of the max
        eps = float(ml_dtypes.finfo(dtype).eps)
        big = float(np.array(big * (1 - 2 * n * eps), dtype))
    inf, nan = math.inf, math.nan
    return [big, -big, ((-1) ** rank) * (rank + 1) * 0.5, -0.0, inf if rank == 0 else 1.0,
            nan if rank == n - 1 else 2.0, inf if rank == 0 else (-inf if rank == 1 else 1.0),
            big / 2, big if rank % 2 == 0 else 3.0, 0.25 * (rank + 1)]


def _wrap(value: int, dtype: np.dtype) -> int:
    bits = 8 * dtype.itemsize
    value %= 1 << bits
    if dtype.kind == "i" and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def _to_float(exact: Fraction, dtype: np.dtype) -> float:
    """``exact`` rounded to ``dtype``'s range: +-inf beyond the largest finite value plus
    half an ulp (round to nearest), else ``exact`` as a float (compared with a tolerance)."""
    big = _float_max(dtype)
    ulp = big - float(np.nextafter(np.array(big, dtype), np.array(0, dtype)).astype(np.float64))
    if abs(exact) >= Fraction(big) + Fraction(ulp) / 2:
        return -math.inf if exact < 0 else math.inf
    return float(exact)


def _float_expected(values: list, op, dtype: np.dtype) -> float:
    """The contract's result of one column of floats (before rounding to ``dtype``)."""
    n = len(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    if op == ddl.Min:
        return min(values)
    if op == ddl.Max:
        return max(values)
    infs = {v for v in values if math.isinf(v)}
    if op == ddl.Product:
        sign = math.prod(math.copysign(1, v) for v in values)
        if infs:
            return sign * math.inf
        if any(v == 0 for v in values):
            return math.copysign(0.0, sign)
        return _to_float(math.prod(Fraction(v) for v in values), dtype)
    if len(infs) == 2:
        return math.nan
    if infs:
        return infs.pop()
    if all(v == 0 and math.copysign(1, v) < 0 for v in values):
        return -0.0
    if op == ddl.Average:
        return _to_float(sum(Fraction(v) for v in values) / n, dtype)
    return _to_float(sum(Fraction(v) for v in values), dtype)


def expected(inputs: List[list], op, dtype: np.dtype) -> np.ndarray:
    """The contract's result over the contributors' ``inputs`` (lists of Python numbers)."""
    n = len(inputs)
    out = []
    for values in zip(*inputs):
        if dtype.kind == "b":
            out.append(all(values) if op == ddl.Min else any(values))
        elif dtype.kind in "iu":
            if op == ddl.Sum:
                out.append(_wrap(sum(values), dtype))
            elif op == ddl.Product:
                out.append(_wrap(math.prod(values), dtype))
            elif op == ddl.Average:
                s = sum(values)
                out.append((abs(s) // n) * (1 if s >= 0 else -1))
            else:
                out.append(min(values) if op == ddl.Min else max(values))
        else:
            out.append(_float_expected(list(values), op, dtype))
    if dtype.kind in "iub":
        return np.array(out, dtype=dtype)
    return np.array(out, dtype=np.float64)


def mismatch(got, want: np.ndarray, dtype: np.dtype, n: int) -> str:
    """'' if ``got`` honours the contract's ``want`` (see the module doc), else why not."""
    got = np.asarray(got)
    if got.dtype != dtype or got.shape != want.shape:
        return f"got {got.dtype}{list(got.shape)}, want {dtype}{list(want.shape)}"
    if dtype.kind in "iub":
        return "" if np.array_equal(got, want) else f"got {got.tolist()}, want {want.tolist()}"
    g = got.astype(np.float64)
    eps = float(ml_dtypes.finfo(dtype).eps)
    bad = []
    for k, (a, b) in enumerate(zip(g.reshape(-1), want.reshape(-1))):
        if math.isnan(b) or math.isinf(b) or b == 0:
            ok = (math.isnan(a) if math.isnan(b) else a == b
                  and math.copysign(1, a) == math.copysign(1, b))
        else:
            ok = math.isfinite(a) and abs(a - b) <= (FLOAT_RTOL + n) * eps * abs(b)
        if not ok:
            bad.append(f"[{k}] {a!r} != {b!r}")
    return "" if not bad else "; ".join(bad)


def _ops(dtype: np.dtype):
    return [ddl.Min, ddl.Max] if dtype.kind == "b" else OPS


def check_edges(process_set=None, tag: str = "", cached: bool = True) -> list:
    """Every dtype x op at its edges, on every path this world offers (module doc).
    ``process_set``: run on that set instead of the global one (no cache there)."""
    ps = process_set if process_set is not None else ddl.global_process_set
    if not ps.included():
        return []
    rank, n = ps.rank(), ps.size()
    failures: List[str] = []
    repeats = 3 if cached and process_set is None else 1

    def check(what: str, call, want, dtype):
        try:
            got = call()
        except Exception as exc:  # noqa: BLE001 - any error is a wrong result here
            failures.append(f"rank {ddl.rank()}: {what}: raised {type(exc).__name__}: "
                            f"{str(exc)[:300]}")
            return
        for g, w in (zip(got, want) if isinstance(got, list) else [(got, want)]):
            why = mismatch(g, w, dtype, n)
            if why:
                failures.append(f"rank {ddl.rank()}: {what}: {why[:600]}")

    for dtype in INT_DTYPES + FLOAT_DTYPES + [np.dtype(np.bool_)]:
        for op in _ops(dtype):
            inputs = [columns(dtype, op, r, n) for r in range(n)]
            mine = np.array(inputs[rank], dtype=dtype)
            want = expected(inputs, op, dtype)
            label = f"{tag}{dtype.name}/{op.name}"
            tiles = max(1, BIG_BYTES // mine.nbytes)
            big, big_want = np.tile(mine, tiles), np.tile(want, tiles)
            other = mine[::-1].copy()
            for step in range(repeats):
                where = f"step {step}" + (" (cached)" if step else "")
                check(f"allreduce {label} {where}",
                      lambda: ddl.allreduce(mine, name=f"edge/{label}", op=op,
                                            process_set=ps), want, dtype)
                check(f"grouped allreduce {label} {where}",
                      lambda: ddl.grouped_allreduce([mine, other], name=f"edge/g/{label}",
                                                    op=op, process_set=ps),
                      [want, want[::-1]], dtype)
                # two large calls at once: fused by the leader, or in one cache cycle
                def two():
                    hs = [ddl.allreduce_async(x, name=f"edge/big{k}/{label}", op=op,
                                              process_set=ps)
                          for k, x in enumerate((big, big[::-1].copy()))]
                    return [h.wait() for h in hs]
                check(f"two large allreduces {label} {where}", two,
                      [big_want, big_want[::-1]], dtype)
                rows = np.stack([np.roll(mine, k) for k in range(2 * n)])
                rows_want = np.stack([np.roll(want, k) for k in range(2 * n)])
                check(f"reducescatter {label} {where}",
                      lambda: ddl.reducescatter(rows, name=f"edge/rs/{label}", op=op,
                                                process_set=ps),
                      rows_want[2 * rank:2 * rank + 2], dtype)
    return failures


def check_scaled_and_joined() -> list:
    """Scale factors meet the contract's order (prescale, reduce, Average, postscale),
    and a joined rank is not counted in an integer or floating Average."""
    rank, n = ddl.rank(), ddl.size()
    failures: List[str] = []

    def expect(got, want, what):
        if not (np.asarray(got).dtype == np.asarray(want).dtype
                and np.array_equal(got, want)):
            failures.append(f"rank {rank}: {what}: got {got!r}, want {want!r}")

    for step in range(3):
        hi = np.iinfo(np.int8).max
        got = ddl.allreduce(np.full(3, hi, np.int8), name="edge/scaled/int8",
                            op=ddl.Average, prescale_factor=0.5, postscale_factor=2.0)
        # 0.5 * 127 -> 63 on each rank; mean 63; times 2 -> 126
        expect(got, np.full(3, 126, np.int8), f"int8 Average scaled step {step}")
        got = ddl.allreduce(np.full(3, 40000, np.float16), name="edge/scaled/f16",
                            op=ddl.Average, postscale_factor=0.5)
        expect(got, np.full(3, 20000, np.float16), f"float16 Average scaled step {step}")
    # rank n-1 joins first: the others average int8 maxima and float16 maxima
    if rank == n - 1:
        ddl.join()
        return failures
    contributors = n - 1
    lo = np.iinfo(np.int8).min
    got = ddl.allreduce(np.array([lo, rank], np.int8), name="edge/join/int8",
                        op=ddl.Average)
    s = sum(range(contributors))
    expect(got, np.array([lo, s // contributors], np.int8), "int8 Average with a joined rank")
    got = ddl.allreduce(np.full(2, 40000, np.float16), name="edge/join/f16", op=ddl.Average)
    expect(got, np.full(2, 40000, np.float16), "float16 Average with a joined rank")
    ddl.join()
    return failures
