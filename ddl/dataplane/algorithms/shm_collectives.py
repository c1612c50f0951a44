"""Collectives among the ranks of one host, through a
:class:`~ddl.dataplane.transports.shm.ShmGroup`.

Every function takes the group and a ``deadline`` (a ``time.monotonic()`` value) and works
for any group size and any length, including 0; a group of one makes no round. Buffers
are changed in place; nothing is allocated per call (the slots of the segment are the
scratch space, and the cross-memory allreduce's one piece per thread, reused). Each call
is a fixed sequence of *rounds* (see :mod:`ddl.dataplane.transports.shm`) derived from its
arguments, so every rank must pass matching arguments, as each function's contract says. A rank that passes different ones gets a
:class:`~ddl.MismatchError` in the first round (and every rank a failure after it).

Reductions use :func:`ddl.dataplane.algorithms.reduce_ufunc` in the buffer's own dtype (the
runtime hands bfloat16 over as float32, as for TCP); ``Average`` is the caller's: a Sum of
inputs it prepared (:mod:`ddl.core.reduction`). Data never crosses the segment more than
once per direction:

* ``allreduce`` up to ``small_bytes`` (default 512 KiB / size): one round. Each rank
  copies its buffer into its slot, then every rank reduces all slots in rank order, so
  results are bitwise equal.
* ``allreduce`` above, where the group may use cross-memory attach
  (:attr:`ShmGroup.cma`) and from :data:`ALLREDUCE_CMA_MIN` bytes: three rounds, and the
  bytes never cross the segment. Each rank reduces its share of the buffer reading the
  others' inputs straight out of their memory, then copies the others' shares of the
  result straight out of theirs (:func:`_allreduce_cma`): per rank, one read of the
  others' shares of the inputs and one of the results, where the segment takes two
  copies of each.
* ``allreduce`` above, otherwise: per chunk of ``slot_bytes``, split into ``size``
  slices, two rounds. Round 1: each rank copies the slices the others reduce into its
  slot, then reduces its own slice of every slot into its buffer (a reduce-scatter).
  Round 2: it puts its reduced slice in its slot and copies everyone else's out (an
  allgather).
* ``reducescatter``: round 1 of the above, with the caller's blocks: each round takes
  a piece of every block, so that every rank both copies and reduces in each round;
  this rank's input may be read from ``src`` (prescaled piece by piece with ``pack``)
  and its block written into ``out`` (no copy in, no copy out).
* ``allgatherv``: the blocks travel through a whole bank per round, each rank writing
  its share of it (and, while that is in the cache, into its own block of the result),
  then copying the others' shares out.
* ``broadcast``: from :data:`BROADCAST_CMA_MIN` bytes on, where the group may use
  cross-memory attach (:attr:`ShmGroup.cma`), the others copy the bytes straight out of
  the root's buffer (one copy instead of two) and the root returns once they are done.
  Otherwise the root writes one piece of the buffer per round
  (:func:`broadcast_piece_bytes`) and fills the next bank while the others still copy
  the previous piece out, so the root's writes and the readers' copies overlap.
* ``alltoallv``: one round to share the counts (in :meth:`ShmGroup.meta_slots`, host
  memory on every group), then each slot is cut into one part per receiver, and the
  blocks move a part's worth per round.
"""

from __future__ import annotations

import math
import os
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ddl.core import faults as _faults
from ddl.core.errors import MismatchError
from ddl.dataplane.algorithms._buffers import (as_uint8, check_array, check_counts, even_offsets,
                                               offsets, scratch)
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.dataplane.transports.shm import ShmGroup, descriptor

SMALL_BYTES_TIMES_SIZE = 512 * 1024   # default small_bytes: 256 KiB at 2 ranks, 128 at 4


def allreduce(buf: np.ndarray, op: int, group: ShmGroup, deadline: float, *,
              small_bytes: Optional[int] = None, algorithm: str = "auto",
              src: Optional[np.ndarray] = None) -> None:
    """Reduce ``buf`` across the group in place; the result is bitwise equal everywhere.

    With ``src`` (1-D, the dtype and length of ``buf``), this rank's contribution is read
    from ``src`` and ``buf`` is only written: the result lands in ``buf`` without a copy
    of the input into it first. ``src`` is not modified.

    Cross-rank contract: every rank passes a 1-D contiguous buffer of the same dtype and
    length, the same ``op``, the same ``small_bytes`` (default
    ``SMALL_BYTES_TIMES_SIZE // size``; capped at the group's ``slot_bytes``) and the same
    ``algorithm`` (see :func:`allreduce_algorithm`).

    Example::

        x = np.arange(4, dtype=np.float32)
        allreduce(x, ReduceOp.Sum, group, time.monotonic() + 60)   # x = size * arange(4)
    """
    check_array(buf, "shm allreduce")
    if src is None:
        src = buf
    elif src.dtype != buf.dtype or src.shape != buf.shape:
        raise ValueError(f"shm allreduce: src is {src.dtype}{list(src.shape)} but buf is "
                         f"{buf.dtype}{list(buf.shape)}")
    elif not src.flags.c_contiguous:   # the peers may read it as plain bytes: copy it here
        np.copyto(buf, src)
        src = buf
    algo = allreduce_algorithm(buf.nbytes, group, small_bytes, algorithm)
    # the chosen algorithm is part of the call's descriptor: ranks that chose differently
    # (a setting that differs between them) get a MismatchError, not each other's bytes
    fn, desc = _plan(_KIND[algo], buf.dtype, op, buf.nbytes)
    group.check("allreduce")
    n = group.size
    if n == 1 or buf.size == 0:
        if src is not buf:
            np.copyto(buf, src)
        return
    try:
        if algo == "one_round":
            _allreduce_small(buf, src, fn, group, deadline, desc)
        elif algo == "cross_memory":
            _allreduce_cma(buf, src, fn, group, deadline, desc)
        else:
            _allreduce_large(buf, src, fn, group, deadline, desc)
    except BaseException as exc:
        group.fail(exc)
        raise


ALLREDUCE_ALGORITHMS = ("auto", "one_round", "reduce_scatter", "cross_memory")
_KIND = {"one_round": "allreduce/one_round", "reduce_scatter": "allreduce",
         "cross_memory": "allreduce/cross_memory"}   # descriptor kinds (shm.KINDS)
# Allreduces from this size on read the peers' memory where the group allows it
# (ShmGroup.cma): below it the segment's rounds are faster, as the kernel's copy out of
# another process costs 2-2.5x a memcpy per byte (more where memcpy runs from a large
# cache); above it, three rounds instead of two per slot win. Where it pays depends on
# the machine (docs/performance.md): from 8 MiB on the first one measured, only from
# 32-64 MiB on a Zen 5 host (2 ranks, 8 MiB: 0.67-0.68 ms through the segment against
# 1.13-1.28 ms; 64 MiB: 7.4-7.8 against 6.4-6.9 ms; at 4 ranks the segment was faster up
# to 32 MiB).
ALLREDUCE_CMA_MIN = 32 << 20


def allreduce_algorithm(nbytes: int, group: ShmGroup, small_bytes: Optional[int] = None,
                        algorithm: str = "auto") -> str:
    """Which algorithm :func:`allreduce` runs for ``nbytes`` (see the module doc).

    ``algorithm`` ``"auto"``: ``"one_round"`` up to ``small_bytes``, then
    ``"cross_memory"`` from :data:`ALLREDUCE_CMA_MIN` where the group may use it, else
    ``"reduce_scatter"``. A forced one is used where it can run: ``"one_round"`` up to
    the slot, ``"cross_memory"`` where :attr:`ShmGroup.cma`; otherwise
    ``"reduce_scatter"``, which always can."""
    if algorithm == "auto":
        if small_bytes is None:
            small_bytes = SMALL_BYTES_TIMES_SIZE // group.size
        if nbytes <= min(small_bytes, group.slot_bytes):
            return "one_round"
        return ("cross_memory" if group.cma and nbytes >= ALLREDUCE_CMA_MIN
                else "reduce_scatter")
    if algorithm == "one_round":
        return "one_round" if nbytes <= group.slot_bytes else "reduce_scatter"
    if algorithm == "cross_memory":
        return "cross_memory" if group.cma else "reduce_scatter"
    if algorithm == "reduce_scatter":
        return "reduce_scatter"
    raise ValueError(f"shm allreduce: unknown algorithm {algorithm!r}; expected one of "
                     f"{', '.join(ALLREDUCE_ALGORITHMS)}")


_plans: dict = {}


def _plan(kind: str, dtype: np.dtype, op: int, nbytes: int):
    """The ufunc and descriptor of a call, cached: a training loop repeats its calls."""
    key = (kind, dtype, op, nbytes)
    plan = _plans.get(key)
    if plan is None:
        plan = (reduce_ufunc(dtype, op), descriptor(kind, nbytes, dtype, op))
        if len(_plans) >= 256:
            _plans.clear()
        _plans[key] = plan
    return plan


def _allreduce_small(buf, src, fn, group: ShmGroup, deadline: float, desc) -> None:
    i, n = group.index, group.size
    if _faults.ACTIVE is not None: _faults.hit("shm.step")
    slots = group.slots(group.begin(deadline, "allreduce"), buf.dtype, buf.size)
    np.copyto(slots[i], src)
    group.publish(desc)
    group.wait_all(deadline, "allreduce", desc)
    # acc = slot 0 (op) slot 1 (op) ... in this order on every rank
    fn(src if i == 0 else slots[0], src if i == 1 else slots[1], out=buf)
    for j in range(2, n):
        fn(buf, slots[j], out=buf)


def reduce_share(fn, own, others, out) -> None:
    """``out = own (op) others[0] (op) others[1] ...``, in that order: how a rank reduces
    its share in the ``reduce_scatter`` allreduce (its own input first, then the peers'
    in rank order). A result completed elsewhere from the same inputs in the same order
    (the response cache's lone place, :mod:`ddl.runtime.cycles`) is bitwise the same."""
    acc = own
    for x in others:
        fn(acc, x, out=out)
        acc = out


def _allreduce_large(buf, src, fn, group: ShmGroup, deadline: float, desc) -> None:
    i, n, dtype = group.index, group.size, buf.dtype
    chunk = group.slot_bytes // dtype.itemsize
    count = buf.size
    for a in range(0, count, chunk):
        if _faults.ACTIVE is not None: _faults.hit("shm.step")
        length = min(chunk, count - a)
        offs = even_offsets(length, n)
        lo, hi = offs[i], offs[i + 1]
        # round 1: hand over the slices the others reduce; reduce mine from every slot
        slots = group.slots(group.begin(deadline, "allreduce"), dtype, length)
        mine = slots[i]
        if lo:
            np.copyto(mine[:lo], src[a:a + lo])
        if hi < length:
            np.copyto(mine[hi:], src[a + hi:a + length])
        group.publish(desc if a == 0 else None)
        group.wait_all(deadline, "allreduce", desc if a == 0 else None)
        out = buf[a + lo:a + hi]
        reduce_share(fn, src[a + lo:a + hi], [slots[j][lo:hi] for j in group.peers], out)
        # round 2: publish my reduced slice, collect everyone else's
        slots = group.slots(group.begin(deadline, "allreduce"), dtype, length)
        np.copyto(slots[i][lo:hi], out)
        group.publish()
        group.wait_all(deadline, "allreduce")
        for j in group.peers:
            np.copyto(buf[a + offs[j]:a + offs[j + 1]], slots[j][offs[j]:offs[j + 1]])


# Bytes of each peer's input read and reduced at a time by the cross-memory allreduce: the
# piece read, this rank's input and the result stay in the core's cache between the read
# and the reduction.
ALLREDUCE_CMA_PIECE = 256 * 1024


def _allreduce_cma(buf, src, fn, group: ShmGroup, deadline: float, desc) -> None:
    """Three rounds, the bytes never through the segment. 1: every rank publishes where
    its input and its result are. Then it reduces its share of the buffer, reading each
    peer's share of the input straight out of the peer's memory, piece by piece, into a
    scratch piece that stays in the cache, and writing the result straight into ``buf``.
    2: every share is reduced (and no input is read any more), so every rank copies the
    others' shares of the result out of their ``buf`` into its own. 3: every rank is done
    reading, so no buffer is read after its owner returns."""
    i, n, dtype = group.index, group.size, buf.dtype
    size = dtype.itemsize
    if _faults.ACTIVE is not None: _faults.hit("shm.step")
    rows = group.slots(group.begin(deadline, "allreduce"), np.dtype(np.uint64), 2)
    rows[i][0] = src.ctypes.data
    rows[i][1] = buf.ctypes.data
    group.publish(desc)
    group.wait_all(deadline, "allreduce", desc)
    where = [(int(r[0]), int(r[1])) for r in rows]
    offs = even_offsets(buf.size, n)
    lo, hi = offs[i], offs[i + 1]
    step = max(1, ALLREDUCE_CMA_PIECE // size)
    tmp = scratch(min(step, hi - lo) * size)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        piece = tmp[:(b - a) * size]
        out, acc = buf[a:b], src[a:b]
        for j in group.peers:
            group.read_peer(j, where[j][0] + a * size, piece, deadline, "allreduce")
            fn(acc, piece.view(dtype), out=out)
            acc = out
    group.begin(deadline, "allreduce")
    group.publish()
    group.wait_all(deadline, "allreduce")
    raw = buf.view(np.uint8)
    for j in group.peers:
        group.read_peer(j, where[j][1] + offs[j] * size,
                        raw[offs[j] * size:offs[j + 1] * size], deadline, "allreduce")
    group.begin(deadline, "allreduce")
    group.publish()
    group.wait_all(deadline, "allreduce")


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


def barrier(group: ShmGroup, deadline: float) -> None:
    """Return once every rank of the group has called ``barrier``."""
    group.check("barrier")
    if group.size == 1:
        return
    desc = descriptor("barrier", 0)
    try:
        group.begin(deadline, "barrier")
        group.publish(desc)
        group.wait_all(deadline, "barrier", desc)
    except BaseException as exc:
        group.fail(exc)
        raise
