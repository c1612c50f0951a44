"""Runs one leader response on this rank: pack, pick a backend, run, unpack, complete.

The data path is the first backend of :data:`ddl.dataplane.backends.ORDER` that supports the call
(:meth:`ddl.dataplane.backends.Backends.pick`); this module never names one.

Reductions (allreduce, reducescatter) follow one contract on every rank and path, owned
by :mod:`ddl.core.reduction`: the dtype the bytes travel in, prescale, Average, postscale and
the cast back.

A member that called :func:`ddl.join` has no entry for a response's tensors and takes
part without data: neutral values in a reduction (not counted by Average), zero rows in
an allgather, nothing either way in an alltoall (the leader refused rows addressed to
it), and in a broadcast it receives into memory it drops (the leader refused a joined
root). Its results are never completed: it has no handle.
Adasum gathers every member's packed buffer and combines them on every rank
(:meth:`Executor._adasum`); a joined member gathers zeros, Adasum's neutral element.

Results are new arrays (large ones in recycled memory, see :mod:`ddl.runtime.results`); inputs
are never written. A response on device memory (``Response.memory``) that this rank holds
as device arrays runs in :mod:`ddl.runtime.device_execute` instead, on the device.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Sequence

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.adasum import combine_into
from ddl.core.dtypes import ReduceOp
from ddl.core.reduction import Reduction, quiet
from ddl.dataplane.backends import Backend, Backends
from ddl.dataplane.transports.base import Group
from ddl.runtime.engine import Entry
from ddl.runtime.layout import row_split
from ddl.runtime.layout import starts as _starts
from ddl.runtime.results import ALIGN as RESULTS_ALIGN
from ddl.runtime.results import RESULTS
from ddl.runtime.timeline import MEMCPY_IN_FUSION_BUFFER, MEMCPY_OUT_FUSION_BUFFER, timeline
from ddl.v1 import coordinator_pb2 as pb

_MAX_PLANS = 64  # reduction plans an executor keeps
_DATA_OPS = frozenset({pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL,
                       pb.REDUCESCATTER})
# agreements the leader's response completes by itself (JOIN's carries the last rank)
_AGREEMENT_OPS = frozenset({pb.BARRIER, pb.JOIN, pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET})


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array."""
    return arr.reshape(-1).view(np.uint8)


def take_setting(config, setting: pb.TuningSetting) -> None:
    """Apply the leader's autotuning ``setting`` (stamped on a response) to this rank's
    ``config``, which every backend reads, unless it is the one already taken."""
    if setting.id != config.tuning_id:
        config.tune(setting.id, {
            "fusion_threshold": int(setting.fusion_threshold_bytes),
            "small_message_bytes": int(setting.small_message_bytes),
            "tcp_chunk_bytes": int(setting.tcp_chunk_bytes),
            "hierarchical_allreduce": setting.hierarchical_allreduce,
            "shm_allreduce_algorithm": setting.shm_allreduce_algorithm})


class Executor:
    """Executes responses for one rank over its backends."""

    def __init__(self, rank: int, backends: Backends, timeout: float):
        self.rank = rank
        self.backends = backends
        self.timeout = timeout
        self._scratch: Dict[np.dtype, np.ndarray] = {}
        self._plans: Dict[tuple, Reduction] = {}
        self._device = None   # device_execute.DeviceExecution, made on first use

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _pick(self, op: int, names, group: Group, nbytes: int, deadline: float,
              memory: str = "") -> Backend:
        """The backend carrying this call; on the Timeline, ``names`` enter the collective
        with its transport and algorithm."""
        backend = self.backends.pick(op, group, nbytes, memory)
        if timeline.active:
            timeline.begin(names, pb.OpType.Name(op), {
                "transport": backend.name,
                "algorithm": backend.algorithm(op, group, nbytes, deadline),
                "bytes": int(nbytes)})
        return backend

    def _fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:count]

    def __call__(self, response: pb.Response, entries: Dict[str, Entry]) -> None:
        if response.HasField("tuning"):
            take_setting(self.backends.plane.config, response.tuning)
        op = response.op
        if op in _AGREEMENT_OPS:   # nothing to move; no group (a watcher is not a member)
            result = ((int(response.new_process_set_id), tuple(response.member_ranks))
                      if op == pb.ADD_PROCESS_SET
                      else int(response.last_joined_rank) if op == pb.JOIN else None)
            for e in entries.values():
                e.handle._set_result(e.finish(result))
            return
        members = list(response.member_ranks) or [self.rank]
        group = Group.of(members, self.rank)
        if response.memory == "cuda" and op in _DATA_OPS:
            from ddl.runtime import device_execute
            device_execute.plan_for(self, group, self._deadline(), entries)  # every member
            if device_execute.on_device(entries):
                if self._device is None:
                    self._device = device_execute.DeviceExecution(self)
                with quiet():
                    self._device(response, entries, group)
                return
        if op == pb.ALLREDUCE:
            with quiet():  # overflow to inf is the contract, not a warning
                self._allreduce(response, entries, group)
        elif op == pb.ALLGATHER:
            self._allgather(response, entries, group)
        elif op == pb.BROADCAST:
            self._broadcast(response, entries, group)
        elif op == pb.ALLTOALL:
            self._alltoall(response, entries, group)
        elif op == pb.REDUCESCATTER:
            with quiet():
                self._reducescatter(response, entries, group)

    # -- allreduce -------------------------------------------------------------------
    def reduction(self, response: pb.Response, group: Group) -> Reduction:
        """The plan of ``response``'s reduction over ``group`` (:mod:`ddl.core.reduction`),
        made once per (dtype, op, scale factors, contributors): a plan never changes."""
        pre, post = response.prescale_factor, response.postscale_factor
        n = group.size - len(response.joined_ranks)
        # with the factors' signs: -0.0 == 0.0, but they scale to zeros of other signs
        key = (response.dtype, response.reduce_op, pre, post, n, math.copysign(1.0, pre),
               math.copysign(1.0, post))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:  # factors that change every step
                self._plans.clear()
            plan = self._plans[key] = Reduction(_dtypes.from_wire(response.dtype),
                                                response.reduce_op, pre, post, n)
        return plan

    def _allreduce(self, response: pb.Response, entries: Dict[str, Entry], group: Group) -> None:
        plan = self.reduction(response, group)
        dtype, wire = plan.dtype, plan.wire
        sizes = [math.prod(t.shape) for t in response.tensors]
        fused = len(response.tensors) > 1 or not plan.in_place
        # fused tensors reduced in their own dtype come back as views of one result
        # buffer (no copy out), each starting on an ALIGN boundary, those of
        # VIEW_MIN_BYTES or more (a small result kept by the caller must not keep the
        # whole buffer alive); else they are copied out of the reused fusion buffer
        views = fused and plan.in_place and plan.op != ReduceOp.Adasum
        counts = [plan.wire_count(n) for n in sizes]
        starts = _starts(counts, RESULTS_ALIGN // wire.itemsize if views else 1)
        total = starts[-1]
        names = [t.name for t in response.tensors]
        if timeline.active and fused:
            timeline.begin(names, MEMCPY_IN_FUSION_BUFFER)
        if views or not fused:
            buf = RESULTS.empty(total, wire)  # becomes the result(s) itself
        else:
            buf = self._fusion_buffer(wire, total)
        deadline = self._deadline()
        # a lone input already in its wire form is read where it is (no copy into buf)
        src = None
        if not fused and plan.reads_input:
            entry = entries.get(response.tensors[0].name)
            if entry is not None and entry.array.dtype == wire and entry.array.flags.c_contiguous:
                src = entry.array.reshape(-1)
        for t, a, count, b in zip(response.tensors, starts, counts,
                                  starts[1:] if src is None else ()):
            entry = entries.get(t.name)
            dst = buf[a:a + count]
            if entry is None:  # this rank joined: contribute the neutral value
                plan.fill_neutral(dst)
            else:
                plan.pack(entry.array, dst)
            if a + count < b:
                buf[a + count:b] = 0  # alignment padding: reduced too, so never garbage
        if plan.op == ReduceOp.Adasum:
            self._adasum(buf, src, counts, names, group, deadline)
        else:
            backend = self._pick(pb.ALLREDUCE, names, group, buf.nbytes, deadline)
            backend.allreduce(buf, plan.algo_op, group, deadline, src=src)
        if timeline.active and fused:
            timeline.begin(names, MEMCPY_OUT_FUSION_BUFFER)
        for t, n, a, count in zip(response.tensors, sizes, starts, counts):
            entry = entries.get(t.name)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                if fused and not (views and count * wire.itemsize >= VIEW_MIN_BYTES):
                    out = plan.finish(buf[a:a + count], RESULTS.empty(n, dtype))
                else:
                    out = plan.finish(buf[a:a + count])
                entry.handle._set_result(entry.finish(out.reshape(tuple(t.shape))))

    def _adasum(self, buf: np.ndarray, src, segments: List[int], names, group: Group,
                deadline: float) -> None:
        """Adasum of the members' packed buffers (``src`` or ``buf``) into ``buf``: an
        allgather (through the backend that carries allgathers; the Timeline shows it as
        ALLGATHER), then every rank combines all members' buffers in member order
        (:func:`ddl.core.adasum.combine_into`), so the results are bitwise equal.
        Memory: ``group.size`` times the buffer."""
        mine = buf if src is None else src
        gathered = np.empty(group.size * buf.size, dtype=buf.dtype)
        backend = self._pick(pb.ALLGATHER, names, group, gathered.nbytes, deadline)
        backend.allgatherv(_bytes(mine), _bytes(gathered), [buf.nbytes] * group.size,
                           group, deadline)
        parts = [gathered[i * buf.size:(i + 1) * buf.size] for i in range(group.size)]
        combine_into(parts, segments, buf)

    # -- data-movement ops -----------------------------------------------------------
    def _allgather(self, response: pb.Response, entries: Dict[str, Entry], group: Group) -> None:
        dtype = _dtypes.from_wire(response.dtype)
        for t in response.tensors:
            entry = entries.get(t.name)
            tail = tuple(int(d) for d in t.shape[1:])
            row_bytes = math.prod(tail) * dtype.itemsize
            firsts = [int(d) for d in t.first_dims]
            out = RESULTS.empty((sum(firsts),) + tail, dtype)
            if entry is None:
                send = np.empty(0, dtype=np.uint8)
            else:
                send = _bytes(np.ascontiguousarray(entry.array))
            counts = [f * row_bytes for f in firsts]
            deadline = self._deadline()
            backend = self._pick(pb.ALLGATHER, [t.name], group, out.nbytes, deadline)
            backend.allgatherv(send, _bytes(out), counts, group, deadline)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                entry.handle._set_result(entry.finish(out))

    def _broadcast(self, response: pb.Response, entries: Dict[str, Entry], group: Group) -> None:
        dtype = _dtypes.from_wire(response.dtype)
        root_index = group.ranks.index(response.root_rank)
        for t in response.tensors:
            entry = entries.get(t.name)  # None: this rank joined
            shape = tuple(int(d) for d in t.shape)
            out = RESULTS.empty(shape, dtype)
            src = None
            if self.rank == response.root_rank:
                x = entry.array
                if x.dtype == dtype and x.shape == shape and x.flags.c_contiguous:
                    src = _bytes(x)  # the backend copies it into out while it sends it
                else:
                    np.copyto(out, x)
            deadline = self._deadline()
            backend = self._pick(pb.BROADCAST, [t.name], group, out.nbytes, deadline)
            backend.broadcast(_bytes(out), root_index, group, deadline, src=src)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                entry.handle._set_result(entry.finish(out))

    def _alltoall(self, response: pb.Response, entries: Dict[str, Entry], group: Group) -> None:
        dtype = _dtypes.from_wire(response.dtype)
        n, me = group.size, group.index
        for t in response.tensors:
            entry = entries.get(t.name)  # None: this rank joined (its splits are all 0)
            tail = tuple(int(d) for d in t.shape[1:])
            row_bytes = math.prod(tail) * dtype.itemsize
            splits = [int(s) for s in t.splits]
            send_rows = splits[me * n:(me + 1) * n]
            recv_rows = [splits[j * n + me] for j in range(n)]
            out = RESULTS.empty((sum(recv_rows),) + tail, dtype)
            send = (np.empty(0, dtype=np.uint8) if entry is None
                    else _bytes(np.ascontiguousarray(entry.array)))
            send_counts = [r * row_bytes for r in send_rows]
            recv_counts = [r * row_bytes for r in recv_rows]
            deadline = self._deadline()
            backend = self._pick(pb.ALLTOALL, [t.name], group, out.nbytes, deadline)
            backend.alltoallv(send, send_counts, _bytes(out), recv_counts, group, deadline)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                entry.handle._set_result(
                    entry.finish((out, np.asarray(recv_rows, dtype=np.int64))))

    def _reducescatter(self, response: pb.Response, entries: Dict[str, Entry],
                       group: Group) -> None:
        plan = self.reduction(response, group)
        dtype = plan.dtype
        for t in response.tensors:
            entry = entries.get(t.name)  # None: this rank joined
            shape = tuple(int(d) for d in t.shape)
            rows = row_split(shape[0], group.size)
            row_elems = math.prod(shape[1:])
            # an input of the wire dtype is read where it is: as it is, or prescaled piece
            # by piece on the way (an Average), with no pass of its own into a buffer
            src = buf = pack = None
            if (entry is not None and plan.in_place and entry.array.dtype == plan.wire
                    and entry.array.flags.c_contiguous):
                src = entry.array.reshape(-1)
                pack = None if plan.reads_input else plan.pack
            else:
                buf = RESULTS.empty(plan.wire_count(math.prod(shape)), plan.wire)
                if entry is None:  # contribute the neutral value
                    plan.fill_neutral(buf)
                else:
                    plan.pack(entry.array, buf)
            counts = [plan.wire_count(r * row_elems) for r in rows]
            out = RESULTS.empty((rows[group.index],) + shape[1:], dtype)
            deadline = self._deadline()
            nbytes = (src if buf is None else buf).nbytes
            backend = self._pick(pb.REDUCESCATTER, [t.name], group, nbytes, deadline)
            if plan.in_place:   # this rank's block is reduced straight into the result
                backend.reducescatter(buf, counts, plan.algo_op, group, deadline, src=src,
                                      out=out.reshape(-1), pack=pack)
                plan.finish(out.reshape(-1))
            else:
                backend.reducescatter(buf, counts, plan.algo_op, group, deadline, src=src)
                start = sum(counts[:group.index])
                plan.finish(buf[start:start + counts[group.index]], out.reshape(-1))
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                entry.handle._set_result(entry.finish(out))


def neutral_value(op: int, dtype: np.dtype):
    """Public for tests: the neutral element of ``op`` on ``dtype``."""
    return Reduction(dtype, op).neutral()


__all__: Sequence[str] = ("Executor", "row_split", "neutral_value")


# the smallest fused result returned as a view of the fused buffer (smaller ones are copied)
VIEW_MIN_BYTES = 64 * 1024
