"""The NCCL communicator's own logic (ddl.dataplane.device.nccl) on a machine without a GPU.

NCCL and CuPy cannot run here, and no lent GPU machine has two GPUs, so the real library
is checked only by tests/gpu (a communicator of one GPU). This module swaps in a small
stand-in for CuPy and NCCL's binding, with NumPy arrays as device memory and threads as
ranks, so that what ddl itself decides is checked in CI: the calls it makes for each
collective and their arguments, the member-order reductions it runs instead of NCCL's
(dtypes NCCL lacks, NaN-keeping Min/Max), argument errors that leave the communicator
usable, and the failure rules (a deadline aborts and breaks the communicator; a member
that never joins fails the join by its deadline; the job's abort check passes through).
"""

from __future__ import annotations

import ctypes
import threading
import time
import types

import numpy as np
import pytest

from ddl.core.dtypes import ReduceOp
from ddl.dataplane.device import cuda, nccl

_TYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
          6: np.float16, 7: np.float32, 8: np.float64}
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class DeviceArray(np.ndarray):
    """A NumPy array standing for a CuPy one: ``.data.ptr`` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def dev(x) -> DeviceArray:
    return np.ascontiguousarray(x).view(DeviceArray)


def _at(ptr: int, count: int, code: int) -> np.ndarray:
    dtype = np.dtype(_TYPES[code])
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dtype)


class FakeLibrary:
    """CuPy's ``cuda`` namespace and ``cupy.cuda.nccl``, as far as the module uses them.
    Kernels run at once in the calling (communicator) thread; ``hang`` makes the named
    rank's stream never finish."""

    def __init__(self):
        self.worlds, self.lock, self.calls, self.aborts = {}, threading.Lock(), [], []
        self.hang = set()
        lib = self

        class Event:
            def __init__(self, block=False, disable_timing=True):
                self.done = True

            def record(self, stream):
                self.done = threading.current_thread().name not in lib.hang

        class Device:
            def __init__(self, index):
                self.index = index

            def use(self):
                return None

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        stream = types.SimpleNamespace(ptr=7, device_id=0)
        self.cupy = types.SimpleNamespace(
            cuda=types.SimpleNamespace(Device=Device, Event=Event,
                                       get_current_stream=lambda: stream),
            empty=lambda n, dtype: dev(np.empty(n, dtype)))
        self.nccl = types.SimpleNamespace(
            available=True, get_version=lambda: 22809, groupStart=lambda: None,
            groupEnd=lambda: None, get_unique_id=lambda: tuple(range(-64, 64)),
            NcclCommunicator=lambda n, uid, rank: Comm(lib, n, uid, rank))


class Comm:
    """One rank of a stand-in communicator: every collective meets its peers in a
    barrier (5 s) and exchanges copies of the bytes."""

    def __init__(self, lib: FakeLibrary, n: int, uid: tuple, rank: int):
        assert all(-128 <= b < 128 for b in uid) and len(uid) == 128
        with lib.lock:
            world = lib.worlds.setdefault(uid, types.SimpleNamespace(
                barrier=threading.Barrier(n), box={}, p2p={}))
        self.lib, self.world, self.rank, self.n = lib, world, rank, n
        world.barrier.wait(timeout=5)

    def _meet(self, key, value):
        self.lib.calls.append((self.rank,) + key)
        self.world.box.setdefault(key, {})[self.rank] = value
        self.world.barrier.wait(timeout=5)
        got = dict(self.world.box[key])
        self.world.barrier.wait(timeout=5)
        self.world.box.pop(key, None)
        return got

    def _reduce(self, got, op):
        acc = got[0].copy()
        for k in range(1, self.n):
            _OPS[op](acc, got[k], out=acc)
        return acc

    def allReduce(self, send, recv, count, code, op, stream):
        assert stream == 7
        got = self._meet(("allReduce", count, code, op), _at(send, count, code).copy())
        _at(recv, count, code)[:] = self._reduce(got, op)

    def reduce(self, send, recv, count, code, op, root, stream):
        got = self._meet(("reduce", count, code, op, root), _at(send, count, code).copy())
        if self.rank == root:
            _at(recv, count, code)[:] = self._reduce(got, op)

    def broadcast(self, send, recv, count, code, root, stream):
        mine = _at(send, count, code).copy() if self.rank == root else None
        _at(recv, count, code)[:] = self._meet(("broadcast", count, code, root), mine)[root]

    def allGather(self, send, recv, count, code, stream):
        got = self._meet(("allGather", count, code), _at(send, count, code).copy())
        _at(recv, count * self.n, code)[:] = np.concatenate([got[k] for k in range(self.n)])

    def send(self, buf, count, code, peer, stream):
        self.lib.calls.append((self.rank, "send", count, peer))
        self.world.p2p[(self.rank, peer)] = _at(buf, count, code).copy()

    def recv(self, buf, count, code, peer, stream):
        self.lib.calls.append((self.rank, "recv", count, peer))
        for _ in range(500):
            got = self.world.p2p.pop((peer, self.rank), None)
            if got is not None:
                _at(buf, count, code)[:] = got
                return
            time.sleep(0.01)
        raise RuntimeError("stand-in recv: nothing came")

    def abort(self):
        self.lib.aborts.append(self.rank)

    def check_async_error(self):
        return None


@pytest.fixture
def lib(monkeypatch):
    fake = FakeLibrary()
    monkeypatch.setattr(cuda, "_cupy", fake.cupy)
    monkeypatch.setattr(cuda, "_tried", True)
    monkeypatch.setattr(nccl, "_nccl", fake.nccl)
    monkeypatch.setattr(nccl, "_tried", True)
    return fake


def _ranks(n, body):
    """Run ``body(comm, rank)`` on ``n`` threads, each a member of one communicator;
    every rank's exception is re-raised here."""
    uid, errors = nccl.unique_id(), {}

    def main(r):
        try:
            comm = nccl.NcclComm(uid, n, r, 0, [10 + k for k in range(n)],
                                 lambda: None).connect(time.monotonic() + 10)
            body(comm, r)
            comm.close()
        except BaseException as exc:   # reported below
            errors[r] = exc

    threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for r in sorted(errors):
        raise errors[r]


def test_every_collective_and_the_member_order_reductions(lib):
    def body(comm, r):
        far = time.monotonic() + 30
        x, out = dev(np.arange(6, dtype=np.float32) + r), dev(np.zeros(6, np.float32))
        comm.allreduce(out, ReduceOp.Sum, far, src=x)
        assert out.tolist() == [2 * i + 1 for i in range(6)]
        assert x.tolist() == [i + r for i in range(6)]          # src is not written
        small = dev(np.array([1, 5, 3], np.int16) * (r + 1))    # no NCCL type: gathered
        comm.allreduce(small, ReduceOp.Max, far)
        assert small.tolist() == [2, 10, 6]
        f = dev(np.array([1.0, np.nan if r else 2.0, 3.0 - r], np.float32))
        comm.allreduce(f, ReduceOp.Min, far)                    # NaN kept, as on the host
        assert f[0] == 1.0 and np.isnan(f[1]) and f[2] == 2.0
        flags = dev(np.array([r == 0, False]))
        comm.allreduce(flags, ReduceOp.Max, far)
        assert flags.tolist() == [True, False]
        b = dev(np.arange(6, dtype=np.float64) * (r + 1))
        comm.reducescatter(b, [2, 4], ReduceOp.Sum, far)        # unequal blocks
        lo, hi = (0, 2) if r == 0 else (2, 6)
        assert b[lo:hi].tolist() == [3.0 * i for i in range(lo, hi)]
        gathered = dev(np.zeros(3, np.uint8))
        comm.allgatherv(dev(np.full(r + 1, r + 5, np.uint8)), gathered, [1, 2], far)
        assert gathered.tolist() == [5, 6, 6]
        even = dev(np.zeros(4, np.uint8))
        comm.allgatherv(dev(np.full(2, r, np.uint8)), even, [2, 2], far)
        assert even.tolist() == [0, 0, 1, 1]
        root_bytes = dev(np.full(4, 9 if r == 1 else 0, np.uint8))
        comm.broadcast(root_bytes, 1, far)
        assert root_bytes.tolist() == [9] * 4
        send = dev(np.array([10 * r, 10 * r + 1, 10 * r + 2], np.uint8))
        counts = [1, 2] if r == 0 else [2, 1]
        got = dev(np.zeros(3, np.uint8))
        comm.alltoallv(send, counts, got, counts, far)
        assert got.tolist() == ([0, 10, 11] if r == 0 else [1, 2, 12])
        # arguments that cannot be right: ValueError, and the communicator still works
        with pytest.raises(ValueError, match="bool"):
            comm.allreduce(flags, ReduceOp.Sum, far)
        with pytest.raises(ValueError, match="counts"):
            comm.reducescatter(b, [1, 1], ReduceOp.Sum, far)
        with pytest.raises(ValueError, match="counts"):
            comm.allgatherv(dev(np.zeros(2, np.uint8)), even, [1, 3], far)
        comm.allreduce(out, ReduceOp.Sum, far, src=x)
        assert out.tolist() == [2 * i + 1 for i in range(6)]

    _ranks(2, body)
    ops = {call[1] for call in lib.calls}
    assert {"allReduce", "reduce", "broadcast", "allGather", "send", "recv"} <= ops
    # float Min went through an allgather, not NCCL's reduction (bool Max did use it)
    reductions = {(c[3], c[4]) for c in lib.calls if c[1] == "allReduce"}
    assert (1, 2) in reductions and not any(code in (6, 7, 8) and op in (2, 3)
                                            for code, op in reductions)
    assert ("reduce" in ops and
            {c[5] for c in lib.calls if c[1] == "reduce"} == {0, 1})   # one per block's owner
    assert lib.aborts == [0, 1] or lib.aborts == [1, 0]    # close() aborts, once each
    # a broadcast moves whole words where its length allows (4 bytes: a uint32; the
    # uneven allgather's 2 bytes from member 1: bytes)
    assert {c[1:] for c in lib.calls if c[1] == "broadcast" and c[4] == 1} == {
        ("broadcast", 1, 3, 1), ("broadcast", 2, 1, 1)}


def test_broadcast_counts_nccl_statuses_and_streams_across_threads():
    # CuPy before 13.4 takes ncclBroadcast's count as a C int: 2 GiB of bytes overflowed
    # from the length alone (the same on every member, whatever its addresses)
    assert nccl.broadcast_pieces(24) == [(0, 3, 5)]       # uint64
    assert nccl.broadcast_pieces(12) == [(0, 3, 3)]       # uint32
    assert nccl.broadcast_pieces(6) == [(0, 6, 1)]        # uint8
    big = 2 ** 31 - 1
    assert nccl.broadcast_pieces(2 ** 31 + 1) == [(0, big, 1), (big, 2, 1)]
    assert nccl.broadcast_pieces(8 * big + 16) == [(0, big, 5), (8 * big, 2, 5)]
    # CuPy's NcclError knows statuses 0-5 only: a dead peer's 6 comes as KeyError(6)
    assert nccl.describe(KeyError(6)) == "ncclRemoteError (6)"
    assert nccl.describe(ValueError("x")) == "x"
    # a caller's per-thread default stream means another stream in the executor's thread:
    # results are handed over, and released, through the legacy default stream instead
    assert cuda.across_threads(cuda.PER_THREAD_STREAM) == cuda.LEGACY_STREAM == 1
    assert cuda.across_threads(0x5000) == 0x5000 and cuda.across_threads(0) == 0


def test_a_deadline_aborts_and_breaks_the_communicator(lib):
    def body(comm, r):
        far = time.monotonic() + 30
        x = dev(np.ones(4, np.float32))
        if r == 0:
            lib.hang.add("rank0")   # this rank's stream never finishes
        start = time.monotonic()
        if r == 0:
            with pytest.raises(nccl.NcclError, match=r"rank 10 .*deadline.*aborted.*DDL_NCCL"):
                comm.allreduce(x, ReduceOp.Sum, time.monotonic() + 0.3)
            assert time.monotonic() - start < 5
            with pytest.raises(nccl.NcclError, match="deadline"):
                comm.broadcast(dev(np.zeros(2, np.uint8)), 0, far)   # broken for good
        else:
            comm.allreduce(x, ReduceOp.Sum, far)

    _ranks(2, body)
    assert lib.aborts.count(0) == 1   # aborted at the deadline; close() did not again


def test_a_member_that_never_joins_and_the_job_s_abort_check(lib):
    start = time.monotonic()
    with pytest.raises(nccl.NcclError, match="init on rank 0 .*deadline"):
        nccl.NcclComm(np.full(128, 200, np.uint8), 2, 0, 0, [0, 1],
                      lambda: None).connect(time.monotonic() + 0.5)
    assert time.monotonic() - start < 3

    class JobFailed(Exception):
        pass

    def abort_check():
        raise JobFailed("rank 1 died")

    with pytest.raises(JobFailed):
        nccl.NcclComm(np.full(128, 201, np.uint8), 2, 0, 0, [0, 1],
                      abort_check).connect(time.monotonic() + 5)
