"""Ring allgather of variable-size byte blocks.

Cross-rank contract: every member passes the same ``counts`` (bytes per member, in
member order) and an ``out`` of ``sum(counts)`` bytes; member ``k`` sends
``counts[k]`` bytes. Afterwards ``out`` holds every member's block, in member order.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ddl.dataplane.algorithms import _ring
from ddl.dataplane.algorithms._buffers import as_uint8, check_counts, offsets
from ddl.dataplane.transports.base import Group, Transport


def allgatherv(send, out: np.ndarray, counts: Sequence[int], group: Group,
               transport: Transport, deadline: float) -> None:
    counts = check_counts(counts, group.size, "allgatherv")
    src = as_uint8(send, "allgatherv send")
    dst = as_uint8(out, "allgatherv out")
    offs = offsets(counts)
    i = group.index
    if src.nbytes != counts[i]:
        raise ValueError(f"allgatherv: member {i} (rank {group.rank}) sends {src.nbytes} "
                         f"bytes but counts[{i}] is {counts[i]}")
    if dst.nbytes != offs[-1]:
        raise ValueError(f"allgatherv: out has {dst.nbytes} bytes but counts sum to "
                         f"{offs[-1]}")
    mine = dst[offs[i]:offs[i + 1]]
    mine[...] = src  # NumPy copies correctly even if src overlaps out
    if group.size > 1:
        _ring.allgather(memoryview(dst), offs, group, transport, deadline)
