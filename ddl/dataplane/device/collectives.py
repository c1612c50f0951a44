"""Collectives on an :class:`~ddl.dataplane.device.ipc_group.IpcGroup` (device slots,
host rounds).

``allreduce``, ``reducescatter`` and ``alltoallv`` are the shared-memory algorithms
themselves (:mod:`ddl.dataplane.algorithms.shm_collectives`): they only use each member's
slot (alltoallv's counts: the host group's, ``meta_slots``), and NumPy's ufuncs and
``np.copyto`` run CuPy's kernels on CuPy arrays. Allreduces up to
:func:`small_bytes` take one round (every member reduces every slot in
member order: bitwise equal everywhere), larger ones a reduce-scatter then an allgather
per slot of device memory. ``allgatherv`` and ``broadcast``
are written here: the host versions use a whole bank shared by all members (or read a
peer's memory directly), while device slots belong to one member each.

Every function follows its host version's cross-rank contract; buffers are 1-D
contiguous CuPy arrays on the group's device, and all the work is queued on the current
stream, which must be the group's (:attr:`IpcGroup.stream`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ddl.core import faults as _faults
from ddl.dataplane.algorithms import shm_collectives as _host
from ddl.dataplane.algorithms._buffers import check_counts, offsets
from ddl.dataplane.transports.shm import descriptor


def small_bytes(group) -> int:
    """Allreduces up to this many bytes take one round: two slots' worth divided by the
    group's size (a whole slot at 2 ranks; 256 MiB with the default slot). On a GPU,
    reading every member's slot costs less than a second round's wait for the GPU (16 MiB
    at 2 ranks: 1.29 ms in two rounds, 0.72 ms in one; docs/gpu.md)."""
    return 2 * group.slot_bytes // group.size


_U8 = np.dtype(np.uint8)


def allreduce(buf, op: int, group, deadline: float, *, src=None,
              algorithm: str = "auto") -> None:
    """:func:`ddl.dataplane.algorithms.shm_collectives.allreduce` on device slots."""
    _host.allreduce(buf, op, group, deadline, src=src, algorithm=algorithm,
                    small_bytes=small_bytes(group))


def allreduce_algorithm(nbytes: int, group, algorithm: str = "auto") -> str:
    return _host.allreduce_algorithm(nbytes, group, small_bytes(group), algorithm)


def reducescatter(buf, counts: Sequence[int], op: int, group, deadline: float, *,
                  src=None, out=None, pack=None) -> None:
    """:func:`ddl.dataplane.algorithms.shm_collectives.reducescatter` on device slots
    (``src``, ``out``, ``pack``: as there)."""
    _host.reducescatter(buf, counts, op, group, deadline, src=src, out=out, pack=pack)


def allgatherv(send, recv, counts: Sequence[int], group, deadline: float) -> None:
    """Every member's ``send`` bytes (uint8), in member order, into ``recv``: per round,
    each member puts up to a slot of its block in its slot and copies the others' out."""
    n, i = group.size, group.index
    counts = check_counts(counts, n, "device allgatherv")
    offs = offsets(counts)
    if send.nbytes != counts[i] or recv.nbytes != offs[-1]:
        raise ValueError(f"device allgatherv: local rank {i} sends {send.nbytes} bytes "
                         f"(counts[{i}] is {counts[i]}) into {recv.nbytes} bytes (counts "
                         f"sum to {offs[-1]})")
    group.check("allgatherv")
    if counts[i]:
        recv[offs[i]:offs[i + 1]] = send
    if n == 1 or offs[-1] == 0:
        return
    desc = descriptor("allgatherv", offs[-1], counts=counts)
    room = group.slot_bytes
    try:
        for k, a in enumerate(range(0, max(counts), room)):
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            slots = group.slots(group.begin(deadline, "allgatherv"), _U8, room)
            b = min(counts[i], a + room)
            if b > a:
                slots[i][:b - a] = send[a:b]
            d = desc if k == 0 else None
            group.publish(d)
            group.wait_all(deadline, "allgatherv", d)
            for j in group.peers:
                bj = min(counts[j], a + room)
                if bj > a:
                    recv[offs[j] + a:offs[j] + bj] = slots[j][:bj - a]
    except BaseException as exc:
        group.fail(exc)
        raise


def broadcast(buf, root: int, group, deadline: float, *, src=None) -> None:
    """Local rank ``root``'s bytes (``src`` there, else ``buf``) into every ``buf``
    (uint8), a slot per round."""
    n, i = group.size, group.index
    if not 0 <= root < n:
        raise ValueError(f"device broadcast: root {root} is outside local ranks 0..{n - 1}")
    source = buf if src is None else src
    if source.nbytes != buf.nbytes:
        raise ValueError(f"device broadcast: src has {source.nbytes} bytes but buf has "
                         f"{buf.nbytes}")
    group.check("broadcast")
    if n == 1 or buf.nbytes == 0:
        if source is not buf:
            buf[:] = source
        return
    desc = descriptor("broadcast", buf.nbytes, root=root)
    step = group.slot_bytes
    try:
        for k, a in enumerate(range(0, buf.nbytes, step)):
            if _faults.ACTIVE is not None: _faults.hit("shm.step")
            b = min(buf.nbytes, a + step)
            d = desc if k == 0 else None
            slots = group.slots(group.begin(deadline, "broadcast"), _U8, b - a)
            if i == root:   # (its own copy first: entering the round waits for both)
                slots[i][:] = source[a:b]
                if source is not buf:
                    buf[a:b] = source[a:b]
                group.publish(d)
                group.wait_all(deadline, "broadcast", d)
            else:   # entering the round says: I have read the previous piece
                group.publish(d)
                group.wait_peer(root, deadline, "broadcast", d)
                buf[a:b] = slots[root]
    except BaseException as exc:
        group.fail(exc)
        raise


def alltoallv(send, send_counts: Sequence[int], recv, recv_counts: Sequence[int], group,
              deadline: float) -> None:
    """:func:`ddl.dataplane.algorithms.shm_collectives.alltoallv` on device slots (the
    counts travel in the host group's slots)."""
    _host.alltoallv(send, send_counts, recv, recv_counts, group, deadline)
