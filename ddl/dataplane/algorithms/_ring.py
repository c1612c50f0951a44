"""The two halves of every ring algorithm: reduce-scatter and allgather.

Segment ``k`` of the buffer (between ``offs[k]`` and ``offs[k+1]``) belongs to member
``k``. Each step sends to the right neighbour and receives from the left one with a
single ``sendrecv``, so all ``size`` members progress together.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.algorithms._buffers import scratch
from ddl.dataplane.transports.base import Group, Transport


def reduce_scatter(buf: np.ndarray, offs: Sequence[int], fn: np.ufunc, group: Group,
                   transport: Transport, deadline: float, chunk_bytes: int,
                   src: Optional[np.ndarray] = None) -> None:
    """Afterwards segment ``group.index`` of ``buf`` (in elements) holds the reduction.

    Each received chunk is reduced into place while the next one is in flight. With
    ``src`` (same dtype and length), this rank's contribution is read from ``src``: a
    member meets each segment once, so ``buf`` is only ever written (the segment it
    sends first comes from ``src``; the others are partial results in ``buf``).
    """
    n, i = group.size, group.index
    right, left = group.peer(i + 1), group.peer(i - 1)
    isz = buf.itemsize
    raw = memoryview(buf.view(np.uint8))
    mine = buf if src is None else src
    first = raw if src is None else memoryview(src.view(np.uint8))
    longest = max(offs[k + 1] - offs[k] for k in range(n))
    tmp_bytes = scratch(longest * isz)
    tmp = tmp_bytes.view(buf.dtype)
    tmp_raw = memoryview(tmp_bytes)
    chunk = max(1, chunk_bytes // isz) * isz
    for s in range(n - 1):
        if _faults.ACTIVE is not None: _faults.hit("ring.step")
        ss = (i - s - 1) % n
        rs = (i - s - 2) % n
        dst = buf[offs[rs]:offs[rs + 1]]
        own = mine[offs[rs]:offs[rs + 1]]

        def on_recv(start: int, stop: int, dst=dst, own=own) -> None:
            a, b = start // isz, stop // isz
            fn(own[a:b], tmp[a:b], out=dst[a:b])

        transport.sendrecv(right, (first if s == 0 else raw)[offs[ss] * isz:offs[ss + 1] * isz],
                           left, tmp_raw[:(offs[rs + 1] - offs[rs]) * isz],
                           deadline, on_recv, chunk)


def allgather(raw: memoryview, offs: Sequence[int], group: Group, transport: Transport,
              deadline: float) -> None:
    """``raw`` (bytes) holds segment ``group.index`` (byte ``offs``); afterwards, all."""
    n, i = group.size, group.index
    right, left = group.peer(i + 1), group.peer(i - 1)
    for s in range(n - 1):
        if _faults.ACTIVE is not None: _faults.hit("ring.step")
        ss = (i - s) % n
        rs = (i - s - 1) % n
        transport.sendrecv(right, raw[offs[ss]:offs[ss + 1]], left, raw[offs[rs]:offs[rs + 1]],
                           deadline)
