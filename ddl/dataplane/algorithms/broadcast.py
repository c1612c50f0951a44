"""Broadcast: binomial tree, or a chunked chain for large buffers.

Cross-rank contract: every member passes a buffer of the same length and the same
``root_index`` (an index into ``group.ranks``). Afterwards every buffer holds the root's.
"""

from __future__ import annotations

import numpy as np

from ddl.core import faults as _faults
from ddl.core.config import default
from ddl.dataplane.algorithms._buffers import as_uint8
from ddl.dataplane.transports.base import Group, Transport


def broadcast(buf: np.ndarray, root_index: int, group: Group, transport: Transport,
              deadline: float, chunk_bytes: int = default("tcp_chunk_bytes")) -> None:
    n = group.size
    if not 0 <= root_index < n:
        raise ValueError(f"broadcast: root index {root_index} is outside the group of {n} "
                         f"members {list(group.ranks)}")
    raw = memoryview(as_uint8(buf, "broadcast"))
    if n == 1 or len(raw) == 0:
        return
    if _faults.ACTIVE is not None: _faults.hit("broadcast.step")
    if n > 2 and len(raw) >= 2 * chunk_bytes:
        _chain(raw, root_index, group, transport, deadline, chunk_bytes)
    else:
        _binomial(raw, root_index, group, transport, deadline)


def _binomial(raw: memoryview, root: int, group: Group, transport: Transport,
              deadline: float) -> None:
    n, i = group.size, group.index
    rel = (i - root) % n
    mask = 1
    while mask < n:
        if rel & mask:
            transport.recv_into(group.peer(i - mask), raw, deadline)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            transport.send(group.peer(i + mask), raw, deadline)
        mask >>= 1


def _chain(raw: memoryview, root: int, group: Group, transport: Transport, deadline: float,
           chunk_bytes: int) -> None:
    """Root -> root+1 -> ...: each middle member forwards chunk k-1 while receiving k."""
    n, i = group.size, group.index
    rel = (i - root) % n
    nxt, prev = group.peer(i + 1), group.peer(i - 1)
    if rel == 0:
        transport.send(nxt, raw, deadline)
        return
    if rel == n - 1:
        transport.recv_into(prev, raw, deadline)
        return
    total = len(raw)
    bounds = list(range(0, total, chunk_bytes)) + [total]
    empty = raw[:0]
    for c in range(len(bounds)):
        if _faults.ACTIVE is not None: _faults.hit("broadcast.step")
        out = raw[bounds[c - 1]:bounds[c]] if c >= 1 else empty
        into = raw[bounds[c]:bounds[c + 1]] if c + 1 < len(bounds) else empty
        transport.sendrecv(nxt, out, prev, into, deadline)
