"""Reduce-scatter with caller-chosen segments (the runtime splits along dim 0).

Cross-rank contract: every member passes a buffer of the same dtype and length, the
same ``counts`` (elements per member, summing to the length) and the same ``op``.
Afterwards member ``k``'s block of ``buf`` (from ``sum(counts[:k])``) holds the
reduction of that block over all members; the other blocks hold partial sums.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ddl.core.config import default
from ddl.dataplane.algorithms import _ring
from ddl.dataplane.algorithms._buffers import check_array, check_counts, offsets
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.dataplane.transports.base import Group, Transport


def reducescatter(buf: np.ndarray, counts: Sequence[int], op: int, group: Group,
                  transport: Transport, deadline: float,
                  chunk_bytes: int = default("tcp_chunk_bytes")) -> None:
    check_array(buf, "reducescatter")
    counts = check_counts(counts, group.size, "reducescatter")
    if sum(counts) != buf.size:
        raise ValueError(f"reducescatter: counts {counts} sum to {sum(counts)} elements but "
                         f"the buffer has {buf.size}")
    fn = reduce_ufunc(buf.dtype, op)
    if group.size == 1 or buf.size == 0:
        return
    _ring.reduce_scatter(buf, offsets(counts), fn, group, transport, deadline, chunk_bytes)
