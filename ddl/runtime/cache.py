"""The response cache: what every rank remembers of agreed calls, by slot.

A training loop submits the same names with the same arguments every step. The leader
gives such a call (a global-set collective of one tensor) a *cache slot* the first time
(``TensorEntry.cache_slot``), and a small one also a place in the cycle segment's inline
area (``cache_inline_offset``). Every rank stores the agreed response under that slot when
it executes it, in the one global order, so all ranks' caches agree. Later calls that
match their slot skip gRPC: :mod:`ddl.runtime.cycles` agrees on them over shared memory.
A call matches its name's slot when this rank's request equals the one that made the slot
(so all the leader validated, :func:`ddl.core.cache_signature.cache_signature`, is the
same too); any other request of the name drops the slot and goes to the leader.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.cache_signature import CACHEABLE_OPS
from ddl.core.dtypes import ReduceOp
from ddl.core.reduction import Reduction
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.runtime.layout import row_split
from ddl.v1 import coordinator_pb2 as pb


class CachedCall:
    """One slot: the agreed one-tensor response, and what running it needs, worked out
    once (a cached call runs without looking at protobufs)."""

    __slots__ = ("slot", "name", "request", "template", "op", "dtype", "shape",
                 "count", "reduce_op", "prescale", "postscale", "root_rank", "inline",
                 "nbytes", "plan", "ufunc", "firsts", "row_bytes", "out_shape", "parts",
                 "group")

    def __init__(self, slot: int, response: pb.Response, tensor: pb.TensorEntry,
                 request: pb.Request, group: str = ""):
        template = pb.Response()
        template.CopyFrom(response)
        del template.tensors[:]
        template.tensors.add().CopyFrom(tensor)
        template.seq = 0
        self.slot = slot
        self.name = tensor.name
        self.group = group  # the name of the group call it is a part of, or ""
        self.request = pb.Request()  # this rank's request that made the slot
        self.request.CopyFrom(request)
        self.request.call_id = 0  # a group's part: its call's number changes every call
        self.template = template
        self.op = response.op
        self.dtype = _dtypes.from_wire(response.dtype)
        self.shape = tuple(int(d) for d in tensor.shape)
        self.out_shape = self.shape  # the result's
        # an allgather or alltoall: every member's input rows (dim 0), in member order,
        # and the bytes of a row; its shape is this rank's own (the tensor's is the
        # lowest member's)
        self.firsts: Tuple[int, ...] = ()
        self.row_bytes = 0
        n = len(response.member_ranks) or 1
        if response.op in (pb.ALLGATHER, pb.ALLTOALL):
            tail = self.shape[1:]
            self.row_bytes = int(np.prod(tail, dtype=np.int64)) * self.dtype.itemsize
            self.shape = tuple(int(d) for d in request.shape)
            if response.op == pb.ALLGATHER:
                self.firsts = tuple(int(d) for d in tensor.first_dims)
                self.out_shape = (sum(self.firsts),) + tail
            else:   # member j sends splits[j * n + i] rows to member i
                splits = tensor.splits
                self.firsts = tuple(sum(splits[j * n:(j + 1) * n]) for j in range(n))
        self.count = int(np.prod(self.shape, dtype=np.int64))
        reducing = response.op in (pb.ALLREDUCE, pb.REDUCESCATTER)
        self.reduce_op = ReduceOp(response.reduce_op) if reducing else None
        self.prescale = float(response.prescale_factor)
        self.postscale = float(response.postscale_factor)
        self.root_rank = int(response.root_rank)
        # byte offset in the inline area, or -1: the bytes go in a collective of their own
        self.inline = (int(tensor.cache_inline_offset)
                       if tensor.HasField("cache_inline_offset") else -1)
        # an allreduce's or reducescatter's reduction plan (the dtype its bytes travel
        # in, packing, finishing); the cache holds global-set calls with no joined ranks
        self.plan = (Reduction(self.dtype, response.reduce_op, self.prescale, self.postscale,
                               n) if reducing else None)
        # what reduces the plan's wire values (the leader refused the ops it lacks)
        # (None for Adasum, which combines all ranks' bytes: ddl.core.adasum)
        self.ufunc = (reduce_ufunc(self.plan.wire, self.plan.algo_op)
                      if self.plan is not None and self.reduce_op != ReduceOp.Adasum
                      else None)
        # this rank's input as it travels: bytes in the inline area, as the leader
        # counted them (inline_bytes), or in the lone place
        self.nbytes = (self.plan.wire_count(self.count) * self.plan.wire.itemsize
                       if self.plan is not None else self.count * self.dtype.itemsize)
        # a reducescatter's and an alltoall's result differs per member: per member index,
        # what it receives (see _parts)
        self.parts: Tuple[tuple, ...] = ()
        if response.op in (pb.REDUCESCATTER, pb.ALLTOALL):
            self.parts = _parts(response.op, tensor, self.shape, self.dtype, self.plan, n)


def _parts(op: int, tensor: pb.TensorEntry, shape: Tuple[int, ...], dtype: np.dtype,
           plan: Optional[Reduction], n: int) -> Tuple[tuple, ...]:
    """Per member index ``i``, what its result is made of, as its collective makes it:

    - a reducescatter: ``(lo, hi, out_shape)``, its block of dim 0 (``row_split``) as
      wire elements ``[lo, hi)`` of every member's packed input;
    - an alltoall: ``(out_shape, received_rows, ((j, at, nbytes), ...))``, the bytes
      member ``j`` sends it, at byte ``at`` of ``j``'s input, in member order.
    """
    tail = shape[1:]
    row_elems = math.prod(tail)
    out = []
    if op == pb.REDUCESCATTER:
        starts = [0]
        for rows in row_split(shape[0], n):
            starts.append(starts[-1] + plan.wire_count(rows * row_elems))
        for i, rows in enumerate(row_split(shape[0], n)):
            out.append((starts[i], starts[i + 1], (rows,) + tail))
        return tuple(out)
    row_bytes = row_elems * dtype.itemsize
    splits = [int(s) for s in tensor.splits]   # member j sends splits[j * n + i] rows to i
    for i in range(n):
        received = tuple(splits[j * n + i] for j in range(n))
        pieces = tuple((j, sum(splits[j * n:j * n + i]) * row_bytes,
                        received[j] * row_bytes) for j in range(n))
        out.append(((sum(received),) + tail, received, pieces))
    return tuple(out)


class ResponseCache:
    """This rank's cache slots (slot numbers start at 1)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._slots: Dict[int, CachedCall] = {}
        self._by_name: Dict[str, int] = {}
        self._dropped: Set[int] = set()

    def insert(self, response: pb.Response, entries: Dict[str, object]) -> None:
        """Store the slotted tensors of ``response`` under the signature of this rank's
        request (``entries``: name -> Entry); call before its handles complete, so that
        a resubmission sees the slot."""
        for t in response.tensors:
            slot = t.cache_slot
            entry = entries.get(t.name)
            if not slot or slot > self.capacity or entry is None:
                continue
            with self._lock:
                if slot in self._dropped or slot in self._slots:
                    continue
                self._slots[slot] = CachedCall(slot, response, t, entry.request,
                                               entry.group)
                self._by_name[t.name] = slot

    def lookup(self, req: pb.Request) -> Tuple[Optional[CachedCall], int]:
        """``(call, 0)`` if ``req`` matches a live slot; ``(None, stale)`` if its name has a
        live slot with other arguments (vote to drop ``stale``); ``(None, 0)`` otherwise."""
        if req.op not in CACHEABLE_OPS or req.process_set_id != 0:
            return None, 0
        with self._lock:
            slot = self._by_name.get(req.name)
            if slot is None or slot in self._dropped:
                return None, 0
            call = self._slots[slot]
            if req == call.request:  # one C comparison (see the module doc)
                return call, 0
            return None, slot

    def drop(self, slots) -> None:
        with self._lock:
            for s in slots:
                self._dropped.add(int(s))
                found = self._slots.pop(int(s), None)
                if found is not None and self._by_name.get(found.name) == int(s):
                    del self._by_name[found.name]

    def siblings(self, group: str, keys) -> List[int]:
        """The live slots of the parts of a group call named ``group`` whose (process
        set, name) is not among ``keys``."""
        with self._lock:
            return [slot for slot, call in self._slots.items()
                    if call.group == group and (0, call.name) not in keys]

    def holds(self, call: CachedCall) -> bool:
        """Whether ``call`` is still its slot's (not dropped); no lock: one dict read."""
        return self._slots.get(call.slot) is call

    def live_slots(self) -> List[int]:
        with self._lock:
            return sorted(self._slots)

    def call(self, slot: int) -> CachedCall:
        with self._lock:
            return self._slots[slot]

    def template(self, slot: int) -> pb.Response:
        return self.call(slot).template
