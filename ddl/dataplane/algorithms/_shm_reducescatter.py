"""Reducescatter on a :class:`~ddl.dataplane.transports.shm.ShmGroup` (the contract every
collective of a host group shares: :mod:`ddl.dataplane.algorithms.shm_collectives`).

Round 1 of the reduce-scatter allreduce (:mod:`._shm_allreduce`), with the caller's
blocks: each round takes a piece of every block, so that every rank both copies and
reduces in each round; this rank's input may be read from ``src`` (prescaled piece by
piece with ``pack``) and its block written into ``out`` (no copy in, no copy out).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.algorithms._buffers import check_array, check_counts, offsets
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.dataplane.algorithms._shm_allreduce import reduce_share
from ddl.dataplane.transports.shm import ShmGroup, descriptor

def reducescatter(buf: Optional[np.ndarray], counts: Sequence[int], op: int,
                  group: ShmGroup, deadline: float, src: Optional[np.ndarray] = None,
                  out: Optional[np.ndarray] = None,
                  pack: Optional[Callable[[np.ndarray, np.ndarray], None]] = None) -> None:
    """Afterwards rank ``k``'s block of ``buf`` (or ``out``) holds the reduction of that
    block.

    Cross-rank contract: every rank passes a buffer of the same dtype and length, the
    same ``counts`` (elements per rank, summing to the length) and the same ``op``. Block
    ``k`` starts at ``sum(counts[:k])``; the other blocks of ``buf`` are left undefined.
    With ``src`` (``buf``'s dtype and length) this rank's input is read from ``src``,
    and ``buf`` may be None; with ``out`` (its block's length) its block of the result
    is written there. With both, ``buf`` is not touched. With ``pack(piece, dst)`` (an
    elementwise map, e.g. :meth:`Reduction.pack <ddl.core.reduction.Reduction.pack>`'s
    prescaling) each piece of ``src`` is packed where it would be copied: no pass of
    its own over the input.

    Each round moves a piece of every block at once (pieces in proportion to the blocks,
    :func:`_pieces`), so that every rank copies the pieces of the others' blocks into
    its slot and reduces a piece of its own in the same round: its own input first, then
    the others' in rank order (:func:`reduce_share`, which the response cache's lone
    place follows too).
    """
    whole = check_array(buf if buf is not None else src, "shm reducescatter")
    n = group.size
    counts = check_counts(counts, n, "shm reducescatter")
    if sum(counts) != whole.size:
        raise ValueError(f"shm reducescatter: counts {counts} sum to {sum(counts)} elements "
                         f"but the buffer has {whole.size}")
    i, dtype = group.index, whole.dtype
    blocks = offsets(counts)
    src = whole if src is None else src
    if out is None and buf is None:
        raise ValueError("shm reducescatter: no buffer and no out for the result")
    res = buf[blocks[i]:blocks[i + 1]] if out is None else out
    if src.shape != whole.shape or src.dtype != dtype or res.size != counts[i] or (
            res.dtype != dtype):
        raise ValueError(f"shm reducescatter: src {src.dtype}{list(src.shape)} and out "
                         f"{res.dtype}[{res.size}] do not fit a buffer of {whole.size} "
                         f"{dtype} with block {counts[i]}")
    fn = reduce_ufunc(dtype, op)
    group.check("reducescatter")
    put = pack if pack is not None else _copy
    if n == 1 or whole.size == 0:
        if res.size and (pack is not None or not np.shares_memory(res, src)):
            put(src[blocks[i]:blocks[i + 1]], res)
        return
    desc = descriptor("reducescatter", whole.nbytes, dtype, op, counts=counts)
    pieces, rounds = _pieces(counts, group.slot_bytes // dtype.itemsize)
    parts = offsets(pieces)   # where each block's piece sits in a slot
    try:
        for k in range(rounds):
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            slots = group.slots(group.begin(deadline, "reducescatter"), dtype, parts[-1])
            mine = slots[i]
            for j in group.peers:   # part j of my slot: my piece of block j
                a = k * pieces[j]
                length = min(pieces[j], counts[j] - a)
                if length > 0:
                    put(src[blocks[j] + a:blocks[j] + a + length],
                        mine[parts[j]:parts[j] + length])
            group.publish(desc if k == 0 else None)
            group.wait_all(deadline, "reducescatter", desc if k == 0 else None)
            a = k * pieces[i]
            length = min(pieces[i], counts[i] - a)
            if length > 0:
                at, own = parts[i], src[blocks[i] + a:blocks[i] + a + length]
                if pack is not None:   # (packed into the result first: in place)
                    own = res[a:a + length]
                    pack(src[blocks[i] + a:blocks[i] + a + length], own)
                reduce_share(fn, own, [slots[j][at:at + length] for j in group.peers],
                             res[a:a + length])
    except BaseException as exc:
        group.fail(exc)
        raise


def _copy(piece, dst) -> None:
    np.copyto(dst, piece)


def _pieces(counts: Sequence[int], room: int) -> Tuple[List[int], int]:
    """``(pieces, rounds)``: the elements of each block that one round of
    :func:`reducescatter` moves, in proportion to the blocks (at least one of a block
    that has any), together at most ``room``; and the rounds that takes. Derived from
    ``counts`` alone, so the same on every rank."""
    total, n = sum(counts), len(counts)
    if room < 2 * n:
        raise ValueError(f"shm reducescatter: slots of {room} elements cannot carry "
                         f"{n} blocks")

    def share(budget: int) -> List[int]:
        return [max(1, budget * c // total) if c else 0 for c in counts]

    # a block whose share rounds down to nothing still gets one element per round
    pieces = share(room - sum(1 for c in counts if c and room * c < total))
    if sum(pieces) > room:
        pieces = share(room - n)
    rounds = max(-(-c // p) for c, p in zip(counts, pieces) if p)
    return pieces, rounds
