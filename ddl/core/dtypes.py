"""Element types and reduce ops: the one table that maps NumPy, the wire enum and names.

bfloat16 comes from ``ml_dtypes`` and is reduced in float32 (the reduction contract is
in :class:`ReduceOp`). Nothing here imports a deep-learning framework.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional

import ml_dtypes
import numpy as np

from ddl.v1 import coordinator_pb2 as pb

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# numpy dtype -> (wire enum, short name). Order is the documented list of dtypes.
_TABLE = [
    (np.dtype(np.uint8), pb.UINT8, "uint8"),
    (np.dtype(np.int8), pb.INT8, "int8"),
    (np.dtype(np.uint16), pb.UINT16, "uint16"),
    (np.dtype(np.int16), pb.INT16, "int16"),
    (np.dtype(np.int32), pb.INT32, "int32"),
    (np.dtype(np.int64), pb.INT64, "int64"),
    (np.dtype(np.float16), pb.FLOAT16, "float16"),
    (BFLOAT16, pb.BFLOAT16, "bfloat16"),
    (np.dtype(np.float32), pb.FLOAT32, "float32"),
    (np.dtype(np.float64), pb.FLOAT64, "float64"),
    (np.dtype(np.bool_), pb.BOOL, "bool"),
]

SUPPORTED_DTYPES = tuple(d for d, _, _ in _TABLE)
SUPPORTED_NAMES = ", ".join(n for _, _, n in _TABLE)
_TO_WIRE: Dict[np.dtype, int] = {d: w for d, w, _ in _TABLE}
_FROM_WIRE: Dict[int, np.dtype] = {w: d for d, w, _ in _TABLE}
_WIRE_NAME: Dict[int, str] = {w: n for _, w, n in _TABLE}


def wire_code(dtype: np.dtype) -> Optional[int]:
    """Wire enum of a NumPy dtype, or None if ddl does not support it."""
    return _TO_WIRE.get(dtype)


def to_wire(dtype: np.dtype) -> int:
    """Wire enum of a NumPy dtype; ``TypeError`` naming the dtype if unsupported."""
    dtype = np.dtype(dtype)
    code = wire_code(dtype)
    if code is None:
        raise TypeError(
            f"ddl does not support dtype {dtype} (kind {dtype.kind!r}); "
            f"supported dtypes are: {SUPPORTED_NAMES}")
    return code


def from_wire(code: int) -> np.dtype:
    """NumPy dtype of a wire enum."""
    try:
        return _FROM_WIRE[code]
    except KeyError:
        raise ValueError(f"unknown wire dtype code {code}") from None


def wire_name(code: int) -> str:
    """Short name ("float32") of a wire dtype, for messages."""
    return _WIRE_NAME.get(code, f"dtype#{code}")


def is_floating(dtype: np.dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == BFLOAT16


class ReduceOp(enum.IntEnum):
    """Reduction of :func:`ddl.allreduce` and :func:`ddl.reducescatter`; the same result on
    every path (shared memory, TCP, hierarchical, fused, cached). ``n`` is the number of
    contributing ranks (ranks that called :func:`ddl.join` do not count).

    * ``Sum``, ``Min``, ``Max``, ``Product`` reduce in the dtype (bfloat16 in float32).
      Integer Sum and Product wrap around modulo ``2**bits``; floating ones saturate to
      +-inf. Min and Max are exact; NaN propagates.
    * ``Average`` on integers: the exact mean of the ``n`` inputs, truncated toward zero;
      it never overflows (summed in int64; int64 as quotient and remainder of ``x / n``).
    * ``Average`` on floats: each input is multiplied by ``prescale / n`` before the sum
      (as NCCL's ``ncclAvg``), so finite inputs do not overflow (but for a rounding when
      the inputs are within about ``n`` ulps of the largest value); float16 is scaled
      with float32 precision, rounded once and summed in float16; bfloat16 in float32.
    * ``prescale``/``postscale`` on integers: truncated toward zero, clipped to the range.
    * On bool, only ``Min`` (logical and) and ``Max`` (logical or) are defined.
    * ``Adasum`` (Horovod's adaptive summation; allreduce of float16, bfloat16, float32
      and float64 only): per tensor, the members' inputs combine pairwise as
      ``(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b`` up a binary tree in member order,
      in float64, rounded once (bfloat16 via float32); any number of ranks (an odd one out is carried up a
      level), see :mod:`ddl.core.adasum`. A joined rank contributes zeros, the neutral
      element. prescale/postscale act as for Sum. Every rank receives every member's
      tensor, so it takes ``n`` times the tensor's memory.

    See :mod:`ddl.core.reduction`, which implements this for every path.

    Example::

        ddl.allreduce(np.array([255], np.uint8), op=ddl.Average)  # 255 on every rank
        ddl.allreduce(np.array([200], np.uint8), op=ddl.Sum)      # 2 ranks: 144 (wraps)
    """

    Sum = pb.SUM
    Average = pb.AVERAGE
    Min = pb.MIN
    Max = pb.MAX
    Product = pb.PRODUCT
    Adasum = pb.ADASUM


Sum = ReduceOp.Sum
Average = ReduceOp.Average
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
Adasum = ReduceOp.Adasum

OP_NAMES = {
    pb.ALLREDUCE: "allreduce",
    pb.ALLGATHER: "allgather",
    pb.BROADCAST: "broadcast",
    pb.ALLTOALL: "alltoall",
    pb.REDUCESCATTER: "reducescatter",
    pb.BARRIER: "barrier",
    pb.JOIN: "join",
    pb.ADD_PROCESS_SET: "add_process_set",
    pb.REMOVE_PROCESS_SET: "remove_process_set",
}


def op_name(op: int) -> str:
    """Lower-case name of a wire OpType, e.g. ``"allreduce"``."""
    return OP_NAMES.get(op, f"op#{op}")


def describe(dtype_code: int, shape) -> str:
    """``float32[17,17]`` style description used in mismatch messages."""
    return f"{wire_name(dtype_code)}[{','.join(str(int(d)) for d in shape)}]"


def client_reduce_op(op, average) -> "ReduceOp":
    """A framework client's reduce op: ``op``, or Horovod's older ``average=`` flag (not
    both); Average when neither is given. An ``op`` that is no ReduceOp is passed on as
    it is: the collective refuses it on every member at once (see ddl._api)."""
    if average is not None:
        if op is not None:
            raise ValueError("allreduce: pass op= or the older average=, not both")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        return ReduceOp(op)
    except (TypeError, ValueError):
        return op
