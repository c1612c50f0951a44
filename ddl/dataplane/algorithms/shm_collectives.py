"""Collectives among the ranks of one host, through a
:class:`~ddl.dataplane.transports.shm.ShmGroup`.

Every function takes the group and a ``deadline`` (a ``time.monotonic()`` value) and works
for any group size and any length, including 0; a group of one makes no round. Buffers
are changed in place; nothing is allocated per call (the slots of the segment are the
scratch space, and the cross-memory allreduce's one piece per thread, reused). Each call
is a fixed sequence of *rounds* (see :mod:`ddl.dataplane.transports.shm`) derived from its
arguments, so every rank must pass matching arguments, as each function's contract says.
A rank that passes different ones gets a :class:`~ddl.MismatchError` in the first round
(and every rank a failure after it).

Reductions use :func:`ddl.dataplane.algorithms.reduce_ufunc` in the buffer's own dtype (the
runtime hands bfloat16 over as float32, as for TCP); ``Average`` is the caller's: a Sum of
inputs it prepared (:mod:`ddl.core.reduction`). Data never crosses the segment more than
once per direction. Each collective's algorithms, and why, are in its own module:

* ``allreduce`` (:mod:`._shm_allreduce`): one round up to ``small_bytes``; above, three
  rounds reading the peers' memory where the group may use cross-memory attach
  (:attr:`ShmGroup.cma <ddl.dataplane.transports.shm.ShmGroup.cma>`), else a
  reduce-scatter then an allgather per slot.
* ``reducescatter`` (:mod:`._shm_reducescatter`): the allreduce's first round, with the
  caller's blocks.
* ``allgatherv`` (:mod:`._shm_allgather`): the blocks through a whole bank per round.
* ``broadcast`` (:mod:`._shm_broadcast`): straight out of the root's memory, or the
  root's pieces through the banks, its writes overlapping the readers' copies.
* ``alltoallv`` (:mod:`._shm_alltoall`): the counts, then a part of each slot per
  receiver.
* ``barrier`` (:mod:`._shm_barrier`): one round.

This module is their face: the backends call the collectives through it, and
:mod:`ddl.dataplane.device.collectives` offers the same calls (but ``barrier``) on device
slots.
"""

from __future__ import annotations

from ddl.dataplane.algorithms._shm_allgather import allgatherv
from ddl.dataplane.algorithms._shm_allreduce import (ALLREDUCE_ALGORITHMS, allreduce,
                                                     allreduce_algorithm, reduce_share)
from ddl.dataplane.algorithms._shm_alltoall import alltoallv
from ddl.dataplane.algorithms._shm_barrier import barrier
from ddl.dataplane.algorithms._shm_broadcast import broadcast
from ddl.dataplane.algorithms._shm_reducescatter import reducescatter

__all__ = ["ALLREDUCE_ALGORITHMS", "allgatherv", "allreduce", "allreduce_algorithm",
           "alltoallv", "barrier", "broadcast", "reduce_share", "reducescatter"]
