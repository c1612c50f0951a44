"""Broadcast on a :class:`~ddl.dataplane.transports.shm.ShmGroup` (the contract every
collective of a host group shares: :mod:`ddl.dataplane.algorithms.shm_collectives`).

From :data:`BROADCAST_CMA_MIN` bytes on, where the group may use cross-memory attach
(:attr:`ShmGroup.cma <ddl.dataplane.transports.shm.ShmGroup.cma>`), the others copy the
bytes straight out of the root's buffer (one copy instead of two) and the root returns
once they are done. Otherwise the root writes one piece of the buffer per round
(:func:`broadcast_piece_bytes`) and fills the next bank while the others still copy the
previous piece out, so the root's writes and the readers' copies overlap.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ddl.core import faults as _faults
from ddl.core.errors import MismatchError
from ddl.dataplane.algorithms._buffers import as_uint8
from ddl.dataplane.transports.shm import ShmGroup, descriptor

def broadcast(buf, root: int, group: ShmGroup, deadline: float, *, src=None) -> None:
    """Afterwards every rank's ``buf`` holds local rank ``root``'s bytes.

    With ``src`` (the root only: a buffer of ``buf``'s byte length), the root reads its
    bytes from ``src`` and copies them into ``buf`` piece by piece while the others read
    them, instead of the caller copying them into ``buf`` first; ``src`` is not modified.

    Cross-rank contract: every rank passes a buffer of the same byte length and the same
    ``root`` (a local rank).
    """
    n, i = group.size, group.index
    if not 0 <= root < n:
        raise ValueError(f"shm broadcast: root {root} is outside local ranks 0..{n - 1}")
    raw = as_uint8(buf, "shm broadcast")
    source = raw
    if src is not None:
        if i != root:
            raise ValueError(f"shm broadcast: local rank {i} passed src but only the root "
                             f"(local rank {root}) sends")
        source = as_uint8(src, "shm broadcast src")
        if source.nbytes != raw.nbytes:
            raise ValueError(f"shm broadcast: src has {source.nbytes} bytes but buf has "
                             f"{raw.nbytes}")
    group.check("broadcast")
    if n == 1 or raw.nbytes == 0:
        if source is not raw:
            raw[:] = source
        return
    desc = descriptor("broadcast", raw.nbytes, root=root)
    if group.cma and raw.nbytes >= BROADCAST_CMA_MIN:
        _broadcast_cma(raw, source, root, group, deadline, desc)
        return
    step = broadcast_piece_bytes(raw.nbytes, group.bank_bytes, n)
    try:
        for k, a in enumerate(range(0, raw.nbytes, step)):
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            b = min(raw.nbytes, a + step)
            d = desc if k == 0 else None
            if i == root:
                bank = group.bank(group.begin(deadline, "broadcast"))
                bank[:b - a] = source[a:b]
                group.publish(d)
                if source is not raw:   # while the others read the piece, from the cache
                    raw[a:b] = source[a:b]
            else:   # entering the round only says: I have read the previous one
                if d is not None:
                    group.begin(deadline, "broadcast")   # the descriptor is data too
                group.publish(d)
                group.wait_peer(root, deadline, "broadcast", d)
                raw[a:b] = group.bank(group.round & 1)[:b - a]
    except BaseException as exc:
        group.fail(exc)
        raise


def _broadcast_cma(raw, source, root: int, group: ShmGroup, deadline: float, desc) -> None:
    """Two rounds. 1: the root publishes where its bytes are; every other rank copies
    them straight out of the root's memory (one copy, where the pieces through the segment
    take two) while the root copies them into its own result if it has ``src``.
    2: everyone says it is done, so the root's bytes are no longer read once it returns
    from a successful call. (After a failure a reader may still be in the middle of one
    piece; it then fails too, without returning what it read.)"""
    try:
        if _faults.ACTIVE is not None: _faults.hit("shm.step")
        if group.index != root and not raw.flags.writeable:  # the kernel would write anyway
            raise ValueError("shm broadcast: the receiving buffer is read-only")
        bank = group.bank(group.begin(deadline, "broadcast"))
        if group.index == root:
            bank[:16].view(np.uint64)[:] = (source.ctypes.data, source.nbytes)
            group.publish(desc)
            if source is not raw:
                raw[:] = source
            group.wait_all(deadline, "broadcast", desc)
            group.publish()
            group.wait_all(deadline, "broadcast")
        else:
            group.publish(desc)
            group.wait_peer(root, deadline, "broadcast", desc)
            address, nbytes = (int(v) for v in bank[:16].view(np.uint64))
            if nbytes != raw.nbytes:   # the descriptors agreed: only a corrupt bank gets here
                raise MismatchError(f"shm broadcast: local rank {root} published {nbytes} "
                                    f"bytes, local rank {group.index} expects {raw.nbytes}",
                                    op="broadcast")
            group.read_peer(root, address, raw, deadline, "broadcast")
            group.publish()
    except BaseException as exc:
        group.fail(exc)
        raise


# Broadcasts from this size on are read from the root's memory where the group allows it
# (ShmGroup.cma): below it the pieces through the segment are faster, as their copies run
# from the cache at several times the kernel's cross-memory copy (2 ranks on a Zen 5 host:
# 1 MiB 73-75 against 113-117 us, 4 MiB 230-280 against 400-415 us, 8 MiB even, 16 MiB
# 1.51-1.62 against 1.38-1.40 ms; docs/performance.md)
BROADCAST_CMA_MIN = 8 << 20
BROADCAST_PIECE_MIN = 64 * 1024
_HOST_CPUS = os.cpu_count() or 1   # the same for every rank of a host (affinity is not)


def broadcast_piece_bytes(nbytes: int, bank_bytes: int, ranks: int = 2,
                          host_cpus: int = _HOST_CPUS) -> int:
    """The bytes :func:`broadcast` moves per round: about ``sqrt(nbytes * 64 KiB)``, a
    multiple of 4 KiB between 64 KiB and a bank. The readers copy piece ``k`` while the
    root writes piece ``k + 1``, so a call takes about one piece's write plus all the
    reads, plus a round's overhead per piece; this size balances the two (1 MiB goes in
    4 pieces of 256 KiB, 16 MiB in 16 of 1 MiB). When the ``ranks`` outnumber the host's
    CPUs they cannot copy at the same time anyway, and every round costs wake-ups: then
    a whole bank per round. Every rank of a host derives the same size."""
    if ranks > host_cpus:
        return bank_bytes
    piece = int(math.isqrt(nbytes * BROADCAST_PIECE_MIN)) & ~4095
    return max(1, min(bank_bytes, max(BROADCAST_PIECE_MIN, piece)))
