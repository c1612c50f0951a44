"""Alltoallv on a :class:`~ddl.dataplane.transports.shm.ShmGroup` (the contract every
collective of a host group shares: :mod:`ddl.dataplane.algorithms.shm_collectives`).

One round to share the counts (in :meth:`ShmGroup.meta_slots
<ddl.dataplane.transports.shm.ShmGroup.meta_slots>`, host memory on every group), then
each slot is cut into one part per receiver, and the blocks move a part's worth per
round.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from ddl.core import faults as _faults
from ddl.core.errors import MismatchError
from ddl.dataplane.algorithms._buffers import as_uint8, check_counts, offsets
from ddl.dataplane.transports.shm import ShmGroup, descriptor

def alltoallv(send, send_counts: Sequence[int], recv, recv_counts: Sequence[int],
              group: ShmGroup, deadline: float) -> None:
    """Rank ``i`` sends block ``j`` of ``send`` to rank ``j``; ``recv`` gets them in order.

    Cross-rank contract: ``send_counts[j]`` (bytes) on rank ``i`` equals ``recv_counts[i]``
    on rank ``j``; ``send`` and ``recv`` hold the blocks back to back. The first round
    shares every rank's ``send_counts`` and ``recv_counts`` beside the first pieces of
    the blocks, so all agree on the number of rounds, and a broken contract is the same
    :class:`~ddl.MismatchError` on every rank rather than a hang.
    """
    n, i = group.size, group.index
    send_counts = check_counts(send_counts, n, "shm alltoallv send_counts")
    recv_counts = check_counts(recv_counts, n, "shm alltoallv recv_counts")
    src, dst = as_uint8(send, "shm alltoallv send"), as_uint8(recv, "shm alltoallv recv")
    soff, roff = offsets(send_counts), offsets(recv_counts)
    if src.nbytes != soff[-1] or dst.nbytes != roff[-1]:
        raise ValueError(f"shm alltoallv: send has {src.nbytes} bytes for counts summing to "
                         f"{soff[-1]}; recv has {dst.nbytes} bytes for counts summing to "
                         f"{roff[-1]}")
    if send_counts[i] != recv_counts[i]:
        raise ValueError(f"shm alltoallv: local rank {i} sends itself {send_counts[i]} bytes "
                         f"but expects {recv_counts[i]}")
    group.check("alltoallv")
    if n == 1:
        dst[roff[i]:roff[i + 1]] = src[soff[i]:soff[i + 1]]
        return
    desc = descriptor("alltoallv", 0)
    # a slot has one part per receiver, rank i's for rank j at part (j - i) % n: part 0,
    # its own, carries no data, and holds the first round's counts (its metadata slot,
    # on a host group the same memory); unless it is too small for them, then they go
    # before the parts
    room = group.slot_bytes // n
    head = 0 if room >= 16 * n else -(-16 * n // 64) * 64
    room = (group.slot_bytes - head) // n
    u8 = np.dtype(np.uint8)
    try:
        start, rounds, k = 0, 1, 0
        while k < rounds:
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            bank = group.begin(deadline, "alltoallv")
            if k == 0:
                meta = group.meta_slots(bank, np.dtype(np.uint64), 2 * n)
                meta[i][:n] = send_counts
                meta[i][n:] = recv_counts
            slots = group.slots(bank, u8, group.slot_bytes)
            for j in group.peers:
                piece = src[soff[j] + start:soff[j] + min(send_counts[j], start + room)]
                at = head + (j - i) % n * room
                slots[i][at:at + piece.nbytes] = piece
            group.publish(desc if k == 0 else None)
            if k == 0:   # its own block while the others write theirs
                dst[roff[i]:roff[i + 1]] = src[soff[i]:soff[i + 1]]
            group.wait_all(deadline, "alltoallv", desc if k == 0 else None)
            if k == 0:
                rounds = _alltoall_rounds([meta[j].tolist() for j in range(n)], room)
            for j in group.peers:
                take = max(0, min(recv_counts[j] - start, room))
                if take:
                    at = head + (i - j) % n * room
                    dst[roff[j] + start:roff[j] + start + take] = slots[j][at:at + take]
            start += room
            k += 1
    except BaseException as exc:
        group.fail(exc)
        raise


def _alltoall_rounds(counts: List[List[int]], room: int) -> int:
    """The rounds of :func:`alltoallv`, from every rank's ``send_counts + recv_counts``
    (the same on every rank); a :class:`~ddl.MismatchError` naming the first pair of
    ranks whose counts do not pair up."""
    n = len(counts)
    longest = 0
    for a in range(n):
        for b in range(n):
            sent, expected = counts[a][b], counts[b][n + a]
            if sent != expected:
                raise MismatchError(
                    f"shm alltoallv: local rank {a} sends {sent} bytes to local rank {b}, "
                    f"which expects {expected}", op="alltoallv", rank_a=a,
                    value_a=str(sent), rank_b=b, value_b=str(expected))
            if a != b:
                longest = max(longest, sent)
    return max(1, -(-longest // room))
