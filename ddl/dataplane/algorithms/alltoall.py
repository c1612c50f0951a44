"""All-to-all of variable-size byte blocks by pairwise exchange.

Cross-rank contract: ``send_counts[k]`` on member ``j`` equals ``recv_counts[j]`` on
member ``k``. ``send`` holds the blocks for members 0..size-1 back to back; afterwards
``recv`` holds the blocks from members 0..size-1 back to back.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.algorithms._buffers import as_uint8, check_counts, offsets
from ddl.dataplane.transports.base import Group, Transport


def alltoallv(send, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int],
              group: Group, transport: Transport, deadline: float) -> None:
    n, i = group.size, group.index
    send_counts = check_counts(send_counts, n, "alltoallv send_counts")
    recv_counts = check_counts(recv_counts, n, "alltoallv recv_counts")
    src = as_uint8(send, "alltoallv send")
    dst = as_uint8(recv, "alltoallv recv")
    soff, roff = offsets(send_counts), offsets(recv_counts)
    if src.nbytes != soff[-1] or dst.nbytes != roff[-1]:
        raise ValueError(f"alltoallv: send has {src.nbytes} bytes for counts summing to "
                         f"{soff[-1]}; recv has {dst.nbytes} bytes for counts summing to "
                         f"{roff[-1]}")
    if send_counts[i] != recv_counts[i]:
        raise ValueError(f"alltoallv: member {i} sends itself {send_counts[i]} bytes but "
                         f"expects {recv_counts[i]}")
    dst[roff[i]:roff[i + 1]] = src[soff[i]:soff[i + 1]]
    smv, rmv = memoryview(src), memoryview(dst)
    for s in range(1, n):
        if _faults.ACTIVE is not None: _faults.hit("alltoall.step")
        to, frm = (i + s) % n, (i - s) % n
        transport.sendrecv(group.peer(to), smv[soff[to]:soff[to + 1]],
                           group.peer(frm), rmv[roff[frm]:roff[frm + 1]], deadline)
