"""Allreduce on a :class:`~ddl.dataplane.transports.shm.ShmGroup`: the choice of
algorithm, and the three algorithms (the contract every collective of a host group
shares: :mod:`ddl.dataplane.algorithms.shm_collectives`).

* up to ``small_bytes`` (default 512 KiB / size): one round. Each rank copies its buffer
  into its slot, then every rank reduces all slots in rank order, so results are bitwise
  equal.
* above, where the group may use cross-memory attach (:attr:`ShmGroup.cma
  <ddl.dataplane.transports.shm.ShmGroup.cma>`) and from :data:`ALLREDUCE_CMA_MIN`
  bytes: three rounds, and the bytes never cross the segment. Each rank reduces its share
  of the buffer reading the others' inputs straight out of their memory, then copies the
  others' shares of the result straight out of theirs (:func:`_allreduce_cma`): per
  rank, one read of the others' shares of the inputs and one of the results, where the
  segment takes two copies of each.
* above, otherwise: per chunk of ``slot_bytes``, split into ``size`` slices, two rounds.
  Round 1: each rank copies the slices the others reduce into its slot, then reduces its
  own slice of every slot into its buffer (a reduce-scatter, :func:`reduce_share`).
  Round 2: it puts its reduced slice in its slot and copies everyone else's out (an
  allgather).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.algorithms._buffers import check_array, even_offsets, scratch
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
         "cross_memory": "allreduce/cross_memory"}   # descriptor kinds (_shm_descriptor.KINDS)
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
