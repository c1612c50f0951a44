"""Allreduce: ring (bandwidth-optimal) and recursive doubling (latency-optimal).

Cross-rank contract: every member of ``group`` calls with a buffer of the same dtype and
length, the same ``op`` and the same algorithm settings. The result replaces ``buf`` in
place and is bitwise identical on every member.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ddl.core import faults as _faults
from ddl.core.config import default
from ddl.dataplane.algorithms import _ring
from ddl.dataplane.algorithms._buffers import check_array, even_offsets, scratch
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.dataplane.transports.base import Group, Transport

ALGORITHMS = ("auto", "ring", "recursive_doubling")


def ring_allreduce(buf: np.ndarray, op: int, group: Group, transport: Transport,
                   deadline: float, chunk_bytes: int = default("tcp_chunk_bytes"),
                   src: Optional[np.ndarray] = None) -> None:
    """Ring reduce-scatter then ring allgather over ``size`` near-equal segments.

    Each member sends ``2 (size-1)/size`` of the buffer; received chunks are reduced
    while later chunks are in flight. With ``src``, the input is read from there and
    ``buf`` only receives the result.
    """
    check_array(buf, "ring_allreduce")
    fn = reduce_ufunc(buf.dtype, op)
    if group.size == 1 or buf.size == 0:
        if src is not None:
            np.copyto(buf, src)
        return
    offs = even_offsets(buf.size, group.size)
    _ring.reduce_scatter(buf, offs, fn, group, transport, deadline, chunk_bytes, src=src)
    isz = buf.itemsize
    _ring.allgather(memoryview(buf.view(np.uint8)), [o * isz for o in offs], group,
                    transport, deadline)


def recursive_doubling_allreduce(buf: np.ndarray, op: int, group: Group,
                                 transport: Transport, deadline: float) -> None:
    """``log2(size)`` exchanges of the whole buffer; for small buffers.

    With a size that is not a power of two, the first ``2 * extra`` members pair up: the
    even one of each pair hands its data to the odd one, sits out, and receives the
    result at the end.
    """
    check_array(buf, "recursive_doubling_allreduce")
    fn = reduce_ufunc(buf.dtype, op)
    n, i = group.size, group.index
    if n == 1 or buf.size == 0:
        return
    raw = memoryview(buf.view(np.uint8))
    tmp_bytes = scratch(buf.nbytes)
    tmp = tmp_bytes.view(buf.dtype)
    tmp_raw = memoryview(tmp_bytes)
    pow2 = 1 << (n.bit_length() - 1)
    extra = n - pow2
    if i < 2 * extra:
        if i % 2 == 0:
            partner = group.peer(i + 1)
            transport.send(partner, raw, deadline)
            transport.recv_into(partner, raw, deadline)
            return
        transport.recv_into(group.peer(i - 1), tmp_raw, deadline)
        fn(buf, tmp, out=buf)
        v = i // 2
    else:
        v = i - extra
    mask = 1
    while mask < pow2:
        if _faults.ACTIVE is not None: _faults.hit("rd.step")
        w = v ^ mask
        partner = group.peer(2 * w + 1 if w < extra else w + extra)
        transport.sendrecv(partner, raw, partner, tmp_raw, deadline)
        fn(buf, tmp, out=buf)
        mask <<= 1
    if i < 2 * extra:
        transport.send(group.peer(i - 1), raw, deadline)


def allreduce(buf: np.ndarray, op: int, group: Group, transport: Transport, deadline: float,
              *, algorithm: str = "auto",
              small_message_bytes: int = default("small_message_bytes"),
              chunk_bytes: int = default("tcp_chunk_bytes"),
              src: Optional[np.ndarray] = None) -> None:
    """Reduce ``buf`` across ``group`` in place (or, with ``src`` of the same dtype and
    length, reduce ``src`` into ``buf``; ``src`` is not modified).

    ``algorithm="auto"`` uses recursive doubling up to ``small_message_bytes`` and the
    ring above; ``"ring"`` or ``"recursive_doubling"`` forces one.

    Example::

        x = np.arange(4, dtype=np.float32)
        allreduce(x, ReduceOp.Sum, group, transport, time.monotonic() + 60)
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"allreduce: unknown algorithm {algorithm!r}; expected one of "
                         f"{', '.join(ALGORITHMS)}")
    check_array(buf, "allreduce")
    if src is not None and (src.dtype != buf.dtype or src.shape != buf.shape):
        raise ValueError(f"allreduce: src is {src.dtype}{list(src.shape)} but buf is "
                         f"{buf.dtype}{list(buf.shape)}")
    if algorithm == "recursive_doubling" or (
            algorithm == "auto" and buf.nbytes <= small_message_bytes):
        if src is not None:
            np.copyto(buf, src)
        recursive_doubling_allreduce(buf, op, group, transport, deadline)
    else:
        ring_allreduce(buf, op, group, transport, deadline, chunk_bytes, src=src)
