"""The executor's device half: a response whose tensors live in CUDA memory
(``Response.memory == "cuda"``) on this rank, run without leaving the device.

It follows :mod:`ddl.runtime.execute` step by step (the same reduction plans, the same
fused layout, the same Timeline records), with device buffers: packing, the collective
and finishing are queued on the data plane's stream of the tensors' device
(:func:`ddl.dataplane.device.cuda.stream`), which first waits for each input's event
(the caller's stream at submission); every result carries the event recorded after its
last kernel, which the caller's stream waits for when the result is handed over. The
host waits only inside the collective, for its own stream, with the call's deadline.

**The device plan.** The first device collective of a group runs a host allgather of
every member's device (its host, GPU UUID, the GPUs it reaches with peer access,
whether it has the device data plane at all and which NCCL it would use):
:func:`ddl.dataplane.backends.device_plan.plan` of that list picks the path, the same on
every member, kept in :attr:`DataPlane.device_plans`. A member without CuPy stages its
arrays through the host and takes part in the exchange too, so then every member stages
(the same host collectives run everywhere).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict

import numpy as np

from ddl.core import dtypes as _dtypes
from ddl.core.dtypes import BFLOAT16, ReduceOp
from ddl.dataplane.backends import device_plan as _plan
from ddl.dataplane.device import cuda
from ddl.dataplane.transports.base import Group
from ddl.runtime.engine import Entry
from ddl.runtime.layout import row_split, starts as _starts
from ddl.runtime.results import ALIGN as RESULTS_ALIGN
from ddl.runtime.timeline import timeline
from ddl.v1 import coordinator_pb2 as pb

_RECORD = 8192   # bytes of one member's device record in the plan's exchange
_U8 = np.dtype(np.uint8)


def plan_for(executor, group: Group, deadline: float,
             entries: Dict[str, Entry]) -> _plan.DevicePlan:
    """``group``'s device plan: agreed once, in its first device collective (module doc).
    Every member calls it at the same point of the global order."""
    plane = executor.backends.plane
    found = plane.device_plans.get(group.ranks)
    if found is not None:
        return found
    mine = _record(plane.hosts.get(executor.rank, ""), entries, plane.config.nccl)
    if on_device(entries):   # the device this rank brings to the group, joined or not
        _GROUP_DEVICE[(id(plane), group.ranks)] = _device_of(entries)
    if group.size == 1:
        infos = [mine]
    else:
        out = np.empty(group.size * _RECORD, np.uint8)
        text = json.dumps(mine).encode()
        if len(text) > _RECORD:   # (about 200 peer GPUs): the plan reaches fewer of them
            mine["peers"] = mine["peers"][:100]
            text = json.dumps(mine).encode()
        raw = np.frombuffer(text.ljust(_RECORD), np.uint8)
        backend = executor.backends.pick(pb.ALLGATHER, group, out.nbytes)
        backend.allgatherv(raw, out, [_RECORD] * group.size, group, deadline)
        infos = [json.loads(bytes(out[k * _RECORD:(k + 1) * _RECORD]).decode())
                 for k in range(group.size)]
    lacking = [group.ranks[k] for k, info in enumerate(infos) if not info["cupy"]]
    devices = [_plan.DeviceInfo(i["host"], i["uuid"], frozenset(i["peers"])) for i in infos]
    # NCCL where every member allows it (DDL_NCCL) and loads the same version; preferred
    # over IPC where every member set DDL_NCCL=on
    versions = {i["nccl"] for i in infos}
    found = _plan.plan(devices, nccl=len(versions) == 1 and 0 not in versions,
                       prefer_nccl=all(i["nccl_on"] for i in infos))
    if lacking:
        found = _plan.DevicePlan(_plan.HOST, found.islands,
                                 f"rank {lacking[0]} has no device data plane (CuPy); "
                                 f"device arrays are staged through host memory")
    plane.device_plans[group.ranks] = found
    return found


def _record(host: str, entries: Dict[str, Entry], nccl_mode: str) -> dict:
    """This member's part of the plan's exchange; ``nccl``: the NCCL version it would use
    (0: none, or ``DDL_NCCL=off``); ``nccl_on``: whether it set ``DDL_NCCL=on``."""
    if not on_device(entries):
        return {"host": host, "uuid": "", "peers": [], "cupy": False, "nccl": 0,
                "nccl_on": False}
    from ddl.dataplane.device import nccl
    uuid, peers = cuda.device_info(_device_of(entries))
    return {"host": host, "uuid": uuid, "peers": list(peers), "cupy": True,
            "nccl": nccl.version() if nccl_mode != "off" else 0,
            "nccl_on": nccl_mode == "on"}


def on_device(entries: Dict[str, Entry]) -> bool:
    """Whether this rank runs the response on the device: its arrays are device views
    (a member that joined, with no arrays: whenever the device plane is there)."""
    for entry in entries.values():
        return isinstance(entry.array, cuda.DeviceArray)
    return cuda.available()


_GROUP_DEVICE: Dict[tuple, int] = {}   # (plane, members) -> this rank's device there


def _device_of(entries: Dict[str, Entry], plane: Any = None, ranks: tuple = ()) -> int:
    """The device of this rank's arrays; with none (it joined), the one it brought to the
    group's first device collective."""
    for entry in entries.values():
        return entry.array.device
    return _GROUP_DEVICE.get((id(plane), ranks), cuda.current_device())


def _values(array: cuda.DeviceArray) -> Any:
    """An input's values as the reduction reads them (bfloat16 widened to float32)."""
    flat = array.data.reshape(-1)
    return cuda.bf16_to_f32(flat) if array.dtype == BFLOAT16 else flat


def _bytes(array: Any) -> Any:
    return array.reshape(-1).view(_U8)


class DeviceExecution:
    """Runs device responses for one :class:`~ddl.runtime.execute.Executor` (its
    backends, reduction plans and Timeline picks)."""

    def __init__(self, executor):
        self.ex = executor

    def __call__(self, response: pb.Response, entries: Dict[str, Entry],
                 group: Group) -> None:
        dev = _device_of(entries, self.ex.backends.plane, group.ranks)
        cp = cuda.cupy()
        stream = cuda.stream(dev)
        with cp.cuda.Device(dev), stream:
            for entry in entries.values():
                if entry.array.event is not None:
                    stream.wait_event(entry.array.event)
            results = getattr(self, _OPS[response.op])(response, entries, group, dev)
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(stream)
        # the inputs stay alive as long as the results (cuda.released_after): reads of
        # them may still be queued
        owners = tuple(entry.array for entry in entries.values())
        for entry, value in results:
            caller = entry.array.caller
            entry.handle._set_result(entry.finish(_stamp(value, done, owners, caller)))

    def _pick(self, op: int, names, group: Group, nbytes: int, deadline: float):
        return self.ex._pick(op, names, group, nbytes, deadline, memory="cuda")

    def _finish(self, plan, wire: Any, count: int, dev: int) -> Any:
        """Reduced wire elements into the result's storage (bfloat16: int16)."""
        if plan.dtype == BFLOAT16:
            return cuda.f32_to_bf16(plan.finish(wire))
        if plan.in_place:
            return plan.finish(wire)
        return plan.finish(wire, cuda.empty(count, plan.dtype, dev))

    def allreduce(self, response, entries, group, dev):
        ex = self.ex
        plan = ex.reduction(response, group)
        wire = plan.wire
        sizes = [math.prod(t.shape) for t in response.tensors]
        fused = len(response.tensors) > 1 or not plan.in_place
        # the host executor's layout, so that a member staging through the host moves
        # the same buffer
        views = fused and plan.in_place and plan.op != ReduceOp.Adasum
        counts = [plan.wire_count(n) for n in sizes]
        starts = _starts(counts, RESULTS_ALIGN // wire.itemsize if views else 1)
        names = [t.name for t in response.tensors]
        buf = cuda.empty(starts[-1], wire, dev)
        # a lone input already in its wire form is read where it is (no copy into buf)
        src = None
        if not fused and plan.reads_input:
            entry = entries.get(names[0])
            if entry is not None and entry.array.data.dtype == wire:
                src = entry.array.data.reshape(-1)
        for t, a, count, b in zip(response.tensors, starts, counts,
                                  starts[1:] if src is None else ()):
            entry = entries.get(t.name)
            dst = buf[a:a + count]
            if entry is None:
                plan.fill_neutral(dst)
            else:
                plan.pack(_values(entry.array), dst)
            if a + count < b:
                buf[a + count:b] = 0
        deadline = ex._deadline()
        if plan.op == ReduceOp.Adasum:   # combined on the host (ddl.core.adasum)
            host = cuda.to_host(buf if src is None else src, deadline, "allreduce")
            ex._adasum(host, None, counts, names, group, deadline)
            buf.set(host)
        else:
            backend = self._pick(pb.ALLREDUCE, names, group, buf.nbytes, deadline)
            backend.allreduce(buf, plan.algo_op, group, deadline, src=src)
        out = []
        for t, n, a, count in zip(response.tensors, sizes, starts, counts):
            entry = entries.get(t.name)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                value = self._finish(plan, buf[a:a + count], n, dev)
                out.append((entry, (value, plan.dtype, tuple(int(d) for d in t.shape))))
        return out

    def allgather(self, response, entries, group, dev):
        dtype = _dtypes.from_wire(response.dtype)
        out = []
        for t in response.tensors:
            entry = entries.get(t.name)
            tail = tuple(int(d) for d in t.shape[1:])
            row = math.prod(tail)
            firsts = [int(d) for d in t.first_dims]
            result = cuda.empty(sum(firsts) * row, dtype, dev)
            send = (cuda.empty(0, _U8, dev) if entry is None
                    else _bytes(entry.array.data))
            deadline = self.ex._deadline()
            backend = self._pick(pb.ALLGATHER, [t.name], group, result.nbytes, deadline)
            backend.allgatherv(send, _bytes(result), [f * row * dtype.itemsize
                                                      for f in firsts], group, deadline)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                out.append((entry, (result, dtype, (sum(firsts),) + tail)))
        return out

    def broadcast(self, response, entries, group, dev):
        dtype = _dtypes.from_wire(response.dtype)
        root_index = group.ranks.index(response.root_rank)
        out = []
        for t in response.tensors:
            entry = entries.get(t.name)
            shape = tuple(int(d) for d in t.shape)
            result = cuda.empty(math.prod(shape), dtype, dev)
            src = None
            if self.ex.rank == response.root_rank:
                src = _bytes(entry.array.data)
            deadline = self.ex._deadline()
            backend = self._pick(pb.BROADCAST, [t.name], group, result.nbytes, deadline)
            backend.broadcast(_bytes(result), root_index, group, deadline, src=src)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                out.append((entry, (result, dtype, shape)))
        return out

    def alltoall(self, response, entries, group, dev):
        dtype = _dtypes.from_wire(response.dtype)
        n, me = group.size, group.index
        out = []
        for t in response.tensors:
            entry = entries.get(t.name)
            tail = tuple(int(d) for d in t.shape[1:])
            row_bytes = math.prod(tail) * dtype.itemsize
            splits = [int(s) for s in t.splits]
            send_rows = splits[me * n:(me + 1) * n]
            recv_rows = [splits[j * n + me] for j in range(n)]
            result = cuda.empty(sum(recv_rows) * math.prod(tail), dtype, dev)
            send = (cuda.empty(0, _U8, dev) if entry is None
                    else _bytes(entry.array.data))
            deadline = self.ex._deadline()
            backend = self._pick(pb.ALLTOALL, [t.name], group, result.nbytes, deadline)
            backend.alltoallv(send, [r * row_bytes for r in send_rows], _bytes(result),
                              [r * row_bytes for r in recv_rows], group, deadline)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                out.append((entry, ((result, dtype, (sum(recv_rows),) + tail),
                                    np.asarray(recv_rows, dtype=np.int64))))
        return out

    def reducescatter(self, response, entries, group, dev):
        plan = self.ex.reduction(response, group)
        out = []
        for t in response.tensors:
            entry = entries.get(t.name)
            shape = tuple(int(d) for d in t.shape)
            rows = row_split(shape[0], group.size)
            row = math.prod(shape[1:])
            # an input of the wire dtype is read where it is (as it is, or prescaled
            # piece by piece on the way: no pack kernel over the whole of it), and this
            # rank's block reduced straight into its result (as on the host)
            src = buf = pack = None
            if (entry is not None and plan.in_place
                    and entry.array.data.dtype == plan.wire):
                src = entry.array.data.reshape(-1)
                pack = None if plan.reads_input else plan.pack
            else:
                buf = cuda.empty(plan.wire_count(math.prod(shape)), plan.wire, dev)
                if entry is None:
                    plan.fill_neutral(buf)
                else:
                    plan.pack(_values(entry.array), buf)
            counts = [plan.wire_count(r * row) for r in rows]
            deadline = self.ex._deadline()
            nbytes = (src if buf is None else buf).nbytes
            backend = self._pick(pb.REDUCESCATTER, [t.name], group, nbytes, deadline)
            if src is not None:   # (the plan is in place)
                mine = cuda.empty(counts[group.index], plan.wire, dev)
                backend.reducescatter(None, counts, plan.algo_op, group, deadline, src=src,
                                      out=mine, pack=pack)
                value = plan.finish(mine)
            else:
                backend.reducescatter(buf, counts, plan.algo_op, group, deadline)
                start = sum(counts[:group.index])
                mine = buf[start:start + counts[group.index]]
                value = self._finish(plan, mine, rows[group.index] * row, dev)
            if timeline.active:
                timeline.end(t.name)
            if entry is not None:
                out.append((entry, (value, plan.dtype, (rows[group.index],) + shape[1:])))
        return out


_OPS = {pb.ALLREDUCE: "allreduce", pb.ALLGATHER: "allgather", pb.BROADCAST: "broadcast",
        pb.ALLTOALL: "alltoall", pb.REDUCESCATTER: "reducescatter"}


def _stamp(value: Any, done: Any, owners: tuple, caller: int) -> Any:
    """``(storage, dtype, shape)`` triples in ``value`` as result ``DeviceArray``\\ s that
    are ready once ``done`` is reached, keep ``owners`` alive, and go back to the pool
    only after the work the caller's stream ``caller`` queued before dropping them."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple):
        return _stamp(value[0], done, owners, caller), value[1]   # alltoall: (result, splits)
    data, dtype, shape = value
    device = data.device.id
    data = cuda.released_after(data.reshape(shape), caller, device, owners)
    return cuda.DeviceArray(data, dtype, shape, device, done, owners)
