"""The plan of one reduction: the dtype its bytes travel in, how an input is packed, and
how the reduced buffer is finished into the result. Every path that reduces (leader
responses, fused or not, reducescatter, the response cache's inline round) runs it.

The contract, the same on every path and transport:

* ``Sum``, ``Min``, ``Max`` and ``Product`` reduce in the tensor's dtype (bfloat16 in
  float32). On integers Sum and Product wrap around modulo ``2**bits``, as NumPy and
  C do; on floats they saturate to +-inf (IEEE). Min and Max are exact; a NaN wins.
* ``Average`` on integers is the exact mean of the contributing ranks, truncated toward
  zero, and never overflows: int8 to int32 (and the unsigned ones) are summed in int64,
  and int64 travels as two int64 lanes per element, the floor quotient and the remainder
  of ``x / n``, whose sums combine into the exact mean.
* ``Average`` on floats scales each input by ``prescale / n`` before the sum (as NCCL's
  ``ncclAvg``), so finite inputs do not overflow, except by rounding when the inputs
  sit within about ``n`` ulps of the largest finite value. The scaling takes one
  rounding: float16 is multiplied by the float32 factor exactly (in float64) and rounded
  to float16, then summed in float16 like a Sum (so ``Compression.fp16`` keeps its
  half-size wire); bfloat16 travels and sums in float32 as for every op.
* ``prescale`` multiplies each input, ``postscale`` the result; on integers the scaled
  value is computed in float64, truncated toward zero and clipped to the dtype's range.
* ``Adasum`` (floating dtypes only) travels as the dtype (bfloat16 as float32), prescaled
  as for Sum; the executor gathers the members' packed buffers and combines them with
  :mod:`ddl.core.adasum` (``algo_op`` stays Adasum: no elementwise ufunc does it), then
  ``finish`` postscales as for Sum. Its neutral value is zero.
* ``n`` counts the contributing ranks: members that called :func:`ddl.join` contribute
  the neutral value of the op and are not counted.

No NumPy floating-point warning escapes: overflow to inf is the contract, not an error.
The same plan runs on device arrays (CuPy's, through NumPy's dispatch) for the device
data plane.
Every rank builds the same plan from the same response, so the wire layout agrees.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ddl.core.dtypes import BFLOAT16, ReduceOp, is_floating

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_F16 = np.dtype(np.float16)
_F64 = np.dtype(np.float64)


def wire_layout(dtype: np.dtype, op: int) -> Tuple[np.dtype, int]:
    """``(wire dtype, lanes)``: what one element of a ``dtype`` tensor reduced with
    ``op`` travels as (``lanes`` wire elements per element). Depends on nothing else, so
    the leader sizes a cached call's inline area from it before any rank runs it."""
    dtype = np.dtype(dtype)
    average = int(op) == ReduceOp.Average
    if dtype == BFLOAT16:
        return _F32, 1
    if average and dtype == _I64:
        return _I64, 2
    if average and dtype.kind in "iu":
        return _I64, 1
    return dtype, 1


def _int_bounds(dtype: np.dtype) -> Tuple[float, float]:
    """The dtype's range as float64 values that cast back into it."""
    info = np.iinfo(dtype)
    hi = float(info.max)
    if int(hi) > int(info.max):  # int64: 2**63 is not an int64
        hi = float(np.nextafter(hi, 0.0))
    return float(info.min), hi


def _scale_int(x: np.ndarray, factor: float, dtype: np.dtype, out: np.ndarray) -> None:
    """``out = clip(trunc(x * factor))`` to ``dtype``'s range, computed in float64."""
    v = np.multiply(x, factor, dtype=np.float64)
    np.trunc(v, out=v)
    np.clip(v, *_int_bounds(dtype), out=v)
    np.copyto(out, v, casting="unsafe")


class Reduction:
    """How one allreduce or reducescatter of ``dtype`` with ``op`` runs (module doc).

    ``wire`` is the dtype the algorithms move and reduce with ``algo_op`` (a plain
    elementwise op: Average runs as Sum); a tensor of ``count`` elements takes
    ``wire_count(count)`` wire elements, and any contiguous range of elements maps to a
    contiguous range of wire elements (lanes are interleaved), so reducescatter blocks
    stay blocks. ``pack`` writes an input, ``finish`` turns reduced wire elements into
    the result. ``reads_input``: the input itself is the wire form (the algorithm may
    read it in place, with no pack).
    """

    __slots__ = ("dtype", "op", "wire", "lanes", "algo_op", "contributors", "postscale",
                 "_factor", "_divisor", "reads_input", "_scalar", "_compute")

    def __init__(self, dtype, op: int, prescale: float = 1.0, postscale: float = 1.0,
                 contributors: int = 1):
        self.dtype = dtype = np.dtype(dtype)
        self.op = op = ReduceOp(op)
        self.wire, self.lanes = wire_layout(dtype, op)
        self.algo_op = ReduceOp.Sum if op == ReduceOp.Average else op
        self.contributors = n = max(1, int(contributors))
        self.postscale = float(postscale)
        floating = is_floating(dtype)
        average = op == ReduceOp.Average
        # the factor applied while packing; integer Average divides when finishing
        self._factor = float(prescale) / n if average and floating else float(prescale)
        self._divisor = n if average and not floating else 1
        self.reads_input = (self.wire == dtype and self.lanes == 1 and self._factor == 1.0
                            and self._divisor == 1)
        # a floating input is scaled in _compute by _scalar: float16 times a float32
        # factor is exact in float64, so the scaled value is rounded once (to float16)
        if self.wire == _F16:
            self._compute, self._scalar = _F64, _F64.type(_F32.type(self._factor))
        else:
            self._compute = self.wire
            self._scalar = self.wire.type(self._factor) if self.wire.kind == "f" else None

    def wire_count(self, count: int) -> int:
        return count * self.lanes

    @property
    def in_place(self) -> bool:
        """The wire form has the result's layout: finish can work in the buffer itself."""
        return self.wire == self.dtype and self.lanes == 1

    def neutral(self):
        """The wire value a rank that joined contributes (every lane)."""
        op, wire = self.algo_op, self.wire
        if op == ReduceOp.Adasum:
            return 0.0  # the zero vector: adasum(x, 0) == x
        if op == ReduceOp.Sum:
            return -0.0 if wire.kind == "f" else 0  # -0.0 + -0.0 is -0.0; 0.0 + -0.0 is not
        if op == ReduceOp.Product:
            return 1
        if wire.kind == "b":
            return op == ReduceOp.Min  # and-identity True, or-identity False
        if wire.kind == "f":
            return np.inf if op == ReduceOp.Min else -np.inf
        info = np.iinfo(wire)
        return info.max if op == ReduceOp.Min else info.min

    def pack(self, x: np.ndarray, dst: np.ndarray) -> None:
        """Write input ``x`` (any shape, ``dtype``) into ``dst`` (1-D, ``wire``,
        ``wire_count(x.size)`` elements), prescaled."""
        flat = x.reshape(-1)
        f = self._factor
        if f == 1.0 and self.lanes == 1:
            np.copyto(dst, flat, casting="unsafe")
        elif self.wire.kind == "f" and 0.0 < abs(f) <= 1.0:
            # the hot path (Average): cannot overflow, and NumPy ignores underflow
            np.multiply(flat, self._scalar, out=dst, dtype=self._compute,
                        casting="unsafe")
        else:
            with quiet():
                self._pack_scaled(flat, f, dst)

    def _pack_scaled(self, flat: np.ndarray, f: float, dst: np.ndarray) -> None:
        if self.lanes == 2:  # int64 Average: floor quotient and remainder of x / n
            if f != 1.0:
                scaled = np.empty_like(flat, dtype=self.dtype)   # (host or device)
                _scale_int(flat, f, self.dtype, scaled)
                flat = scaled
            if isinstance(dst, np.ndarray):
                np.divmod(flat, self._divisor, out=(dst[0::2], dst[1::2]))
            else:   # a device array (CuPy takes no tuple of outputs)
                dst[0::2], dst[1::2] = np.divmod(flat, self._divisor)
        elif self.wire.kind == "f":
            np.multiply(flat, self._scalar, out=dst, dtype=self._compute,
                        casting="unsafe")
        else:
            _scale_int(flat, f, self.dtype, dst)

    def fill_neutral(self, dst: np.ndarray) -> None:
        dst.fill(self.neutral())

    def finish(self, buf: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The result of reduced wire elements ``buf``: written into ``out`` (1-D,
        ``dtype``) when given, else (``in_place`` plans only) into ``buf``; returned."""
        if (out is None and self.lanes == 1 and self._divisor == 1
                and self.postscale == 1.0):
            return buf  # nothing to do (the hot path)
        with quiet():
            if self.lanes == 2:
                v = self._combine(buf)
            else:
                v = buf
                if self._divisor != 1:
                    _trunc_divide(v, self._divisor)
            post = self.postscale
            if post != 1.0:
                if v.dtype == _F16:   # as pack scales: in float64, rounded once
                    np.multiply(v, _F64.type(_F32.type(post)), out=v, dtype=_F64,
                                casting="unsafe")
                elif v.dtype.kind == "f":
                    v *= v.dtype.type(post)
                elif v.dtype.kind != "b":
                    _scale_int(v, post, self.dtype, v)
            if out is None:
                return v
            np.copyto(out, v, casting="unsafe")
            return out

    def _combine(self, buf: np.ndarray) -> np.ndarray:
        """int64 Average: sum(q) + sum(r) / n, truncated toward zero (wrapping int64
        arithmetic is exact here: the mean itself is in range)."""
        n = self._divisor
        q, r = buf[0::2], buf[1::2]  # sum(r) < n * n: no overflow
        extra, rem = np.divmod(r, n)
        mean = np.add(q, extra)  # floor of the mean
        mean += (rem != 0) & (mean < 0)
        return mean


def _trunc_divide(buf: np.ndarray, n: int) -> None:
    """``buf //= n`` truncated toward zero, in place (|sums| here stay far from the
    int64 limits: they are sums of at most 32-bit values)."""
    negative = buf < 0
    np.abs(buf, out=buf)
    np.floor_divide(buf, n, out=buf)
    if isinstance(buf, np.ndarray):
        np.negative(buf, out=buf, where=negative)
    else:   # a device array (CuPy's ufuncs take no where=)
        np.copyto(buf, -buf, where=negative)


def quiet() -> np.errstate:
    """The floating-point error state reductions run under: overflow to inf and NaN
    arithmetic are the contract, so NumPy warns about neither."""
    return np.errstate(all="ignore")
