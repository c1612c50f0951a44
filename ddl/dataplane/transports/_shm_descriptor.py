"""The three integers that describe one collective call on a shared-memory group: every
local rank publishes them with the call's first round, and its peers compare them with
their own (:meth:`ShmGroup.wait_all <ddl.dataplane.transports.shm.ShmGroup.wait_all>`),
so ranks that run different calls fail with a :class:`~ddl.MismatchError` instead of
reading each other's bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ddl.core.dtypes import BFLOAT16, ReduceOp

KINDS = ("", "allreduce", "allgatherv", "broadcast", "reducescatter", "barrier", "alltoallv",
         "cycle", "allreduce/one_round", "allreduce/cross_memory", "connect")


def descriptor(kind: str, nbytes: int, dtype: Optional[np.dtype] = None, op: int = 0,
               root: int = -1, counts: Sequence[int] = ()) -> Tuple[int, int, int]:
    """Three integers that describe one collective call, compared across local ranks."""
    char, size = (ord(dtype.char), dtype.itemsize) if dtype is not None else (0, 0)
    word = (KINDS.index(kind) | (int(op) & 0xFF) << 8 | char << 16 | (size & 0xFF) << 24
            | (root + 1) << 32)
    return word, nbytes, hash(tuple(int(c) for c in counts)) & 0xFFFFFFFFFFFFFFFF


def describe(desc: Sequence[int]) -> str:
    """``descriptor`` in words, for mismatch messages."""
    word, nbytes, counts = desc
    kind, op, char = word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF
    parts = [f"{nbytes} bytes"]
    if char:
        try:
            name = BFLOAT16.name if chr(char) == BFLOAT16.char else np.dtype(chr(char)).name
        except TypeError:
            name = f"dtype {chr(char)!r}"
        parts[0] += f" of {name}"
    if op:
        parts.append(f"op {ReduceOp(op).name if op in ReduceOp._value2member_map_ else op}")
    if word >> 32:
        parts.append(f"root {(word >> 32) - 1}")
    if counts != descriptor("", 0)[2]:
        parts.append(f"counts #{counts:016x}")
    name = KINDS[kind] if kind < len(KINDS) else f"kind {kind}"
    return f"{name}({', '.join(parts)})"
