"""Allgatherv on a :class:`~ddl.dataplane.transports.shm.ShmGroup` (the contract every
collective of a host group shares: :mod:`ddl.dataplane.algorithms.shm_collectives`).

The blocks travel through a whole bank per round, each rank writing its share of it
(and, while that is in the cache, into its own block of the result), then copying the
others' shares out.
"""

from __future__ import annotations

from typing import Sequence

from ddl.core import faults as _faults
from ddl.dataplane.algorithms._buffers import as_uint8, check_counts, even_offsets, offsets
from ddl.dataplane.transports.shm import ShmGroup, descriptor

def allgatherv(send, recv, counts: Sequence[int], group: ShmGroup, deadline: float) -> None:
    """Every rank's block of bytes, concatenated in rank order, into ``recv``.

    Cross-rank contract: every rank passes the same ``counts`` (bytes per rank) and a
    ``recv`` of ``sum(counts)`` bytes; rank ``k`` sends ``counts[k]`` bytes. ``send`` and
    ``recv`` are arrays, memoryviews or other writable byte buffers.
    """
    n, i = group.size, group.index
    counts = check_counts(counts, n, "shm allgatherv")
    src, dst = as_uint8(send, "shm allgatherv send"), as_uint8(recv, "shm allgatherv recv")
    offs = offsets(counts)
    if src.nbytes != counts[i]:
        raise ValueError(f"shm allgatherv: local rank {i} sends {src.nbytes} bytes but "
                         f"counts[{i}] is {counts[i]}")
    if dst.nbytes != offs[-1]:
        raise ValueError(f"shm allgatherv: recv has {dst.nbytes} bytes but counts sum to "
                         f"{offs[-1]}")
    group.check("allgatherv")
    total = offs[-1]
    if n == 1 or total == 0:
        dst[offs[i]:offs[i + 1]] = src
        return
    desc = descriptor("allgatherv", total, counts=counts)
    room = group.bank_bytes - n               # each round's pieces fit in one bank
    rounds = -(-total // room)
    pieces = [even_offsets(c, rounds) for c in counts]
    try:
        for k in range(rounds):
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            at = offsets([p[k + 1] - p[k] for p in pieces])
            bank = group.bank(group.begin(deadline, "allgatherv"))
            a, b = pieces[i][k], pieces[i][k + 1]
            bank[at[i]:at[i + 1]] = src[a:b]
            group.publish(desc if k == 0 else None)
            dst[offs[i] + a:offs[i] + b] = src[a:b]   # while it is in the cache
            group.wait_all(deadline, "allgatherv", desc if k == 0 else None)
            for j in group.peers:
                if at[j + 1] > at[j]:
                    start = offs[j] + pieces[j][k]
                    dst[start:start + at[j + 1] - at[j]] = bank[at[j]:at[j + 1]]
    except BaseException as exc:
        group.fail(exc)
        raise
