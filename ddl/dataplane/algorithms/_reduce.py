"""Elementwise reduction of one buffer into another, in place, with NumPy ufuncs.

Average is not a reduction here: the runtime runs ``Sum`` on inputs it has prepared
(scaled by 1/n, or widened to int64; see :mod:`ddl.core.reduction`). bfloat16 reduces
natively through ``ml_dtypes``' ufuncs; the runtime hands it over as float32.
"""

from __future__ import annotations

import numpy as np

from ddl.core.dtypes import ReduceOp

_NUMERIC = {
    ReduceOp.Sum: np.add,
    ReduceOp.Min: np.minimum,
    ReduceOp.Max: np.maximum,
    ReduceOp.Product: np.multiply,
}
_BOOL = {ReduceOp.Min: np.logical_and, ReduceOp.Max: np.logical_or}


def reduce_ufunc(dtype: np.dtype, op: int) -> np.ufunc:
    """The ufunc that reduces ``op`` on ``dtype``; ``ValueError`` if it is not defined."""
    op = ReduceOp(op)
    if np.dtype(dtype) == np.bool_:
        fn = _BOOL.get(op)
        if fn is None:
            raise ValueError(f"reduce op {op.name} is not defined on bool tensors; use Min "
                             f"(logical and) or Max (logical or)")
        return fn
    fn = _NUMERIC.get(op)
    if fn is None:
        raise ValueError(f"reduce op {op.name} is not an elementwise reduction; the caller "
                         f"must run Sum and divide")
    return fn


def reduce_into(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """``dst = dst (op) src`` elementwise, in place."""
    fn = reduce_ufunc(dst.dtype, op)
    fn(dst, src, out=dst)
