"""NCCL communicators for the device data plane, through CuPy's binding (``cupy.cuda.nccl``).

Why this binding: the device data plane already runs on CuPy (its streams, events and
kernels), CuPy finds the NCCL library that its CUDA wheels bring, and the binding has
what the failure rules need (``ncclCommAbort``, ``ncclCommGetAsyncError``) without a
compiler or torch's headers. torch's own NCCL is reachable only through
``torch.distributed``'s process groups, which own their communicators and rendezvous;
the ``nvidia-nccl`` wheel through ctypes would mean writing and keeping a binding.

An :class:`NcclComm` is one rank's membership of one communicator: the members' first
rank makes NCCL's unique id, the members' host data path hands it to the others (the job's
authenticated channels, never gRPC), and every member joins it on its own GPU. NCCL refuses
two members on one GPU, so :mod:`ddl.dataplane.backends.device_plan` never puts such ranks
in one communicator. NCCL's own connections are NCCL's: ddl authenticates the hand-over
of the id, not NCCL's sockets (keep them on a trusted network, ``NCCL_SOCKET_IFNAME``).

**No call waits for ever.** Every call into NCCL that may wait for the peers (joining,
queueing a collective, which may set up connections, aborting) runs in the communicator's
own host thread, and every collective is queued on the current CUDA stream (the data
plane's); the calling thread then waits (:meth:`NcclComm.wait`) for the host call and for
an event on that stream, polling NCCL's asynchronous error and the job's abort check,
until the deadline. A failure or the deadline aborts the communicator
(``ncclCommAbort``, which ends this rank's NCCL kernels and calls) and raises the job's
own error if the job names one within a second (most NCCL failures are a peer's: it died,
or aborted its communicator because the job failed; the job then names that peer, e.g.
:class:`~ddl.PeerLostError`), else :class:`NcclError`: a local failure inside a
collective, which the engine reports so that the job fails on every rank (the peers'
waits then end through their abort checks, and they abort their communicators too). Every later call on a broken communicator raises
the same error.

**Results.** NCCL's rings and trees hand every member the bytes that one reduction
produced, so results are bitwise equal on every member. Where NCCL would differ from the
host paths, the members' arrays are gathered and reduced in member order on the device
instead: dtypes NCCL has no type for (int16, uint16), and Min/Max on floats (NCCL's
``fminf``/``fmaxf`` drop a NaN; ddl's Min and Max propagate it).

CuPy and NCCL are imported on first use; :func:`available` says whether they load.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ddl.core import faults as _faults
from ddl.core.dtypes import ReduceOp
from ddl.dataplane.algorithms._buffers import check_counts, offsets
from ddl.dataplane.algorithms._reduce import reduce_ufunc
from ddl.dataplane.device import cuda

# ncclDataType_t and ncclRedOp_t: NCCL's public ABI (nccl.h), the same in every NCCL 2.x
_TYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.bool_): 1,
          np.dtype(np.int32): 2, np.dtype(np.uint32): 3, np.dtype(np.int64): 4,
          np.dtype(np.uint64): 5, np.dtype(np.float16): 6, np.dtype(np.float32): 7,
          np.dtype(np.float64): 8}
_OPS = {ReduceOp.Sum: 0, ReduceOp.Product: 1, ReduceOp.Max: 2, ReduceOp.Min: 3}
_U8 = 1   # ncclUint8: every byte-moving collective
# CuPy before 13.4 declares ncclBroadcast's count a C int (its other collectives take a
# size_t): broadcasts go in pieces of at most this many elements
_INT_MAX = 2 ** 31 - 1
_WORDS = ((8, 5), (4, 3), (1, _U8))   # (bytes, ncclDataType_t): uint64, uint32, uint8
UNIQUE_ID_BYTES = 128
_CHECK_S = 0.05   # how often a wait asks NCCL and the job whether something failed
_ABORT_WAIT_S = 5.0   # ncclCommAbort may wait for the peers' aborts: not longer than this
_CAUSE_WAIT_S = 1.0   # how long a failure waits for the job to name a peer's (as the engine)

_lock = threading.Lock()
_nccl: Any = None
_tried = False


# ncclResult_t (nccl.h): CuPy's NcclError names only 0-5, and raises KeyError(status) for
# the others, such as the ncclRemoteError that a dead peer causes
_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
            4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
            7: "ncclInProgress"}


def describe(exc: BaseException) -> str:
    """What an exception from CuPy's NCCL binding says, with the NCCL status named."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], int):
        code = exc.args[0]
        return f"{_RESULTS.get(code, 'unknown NCCL status')} ({code})"
    return str(exc)


def broadcast_pieces(nbytes: int) -> list:
    """The ``ncclBroadcast`` calls that move ``nbytes``: ``(byte offset, count, datatype)``
    each, in the widest word that divides the length, every count within a C int (see
    :data:`_INT_MAX`). From the length alone, the same on every member (NCCL moves a
    broadcast as bytes whatever its datatype, so addresses need no alignment)."""
    size, code = next((w, c) for w, c in _WORDS if not nbytes % w)
    total = nbytes // size
    return [(at * size, min(_INT_MAX, total - at), code)
            for at in range(0, total, _INT_MAX)]


def _broadcast(comm, send: int, recv: int, nbytes: int, root: int, stream: int) -> None:
    """Queue the broadcast of ``nbytes`` (in a group when it takes several pieces)."""
    for at, count, code in broadcast_pieces(nbytes):
        comm.broadcast(send + at, recv + at, count, code, root, stream)


class NcclError(RuntimeError):
    """This rank's NCCL communicator failed (NCCL's error, the deadline, a peer that never
    joined); the communicator is aborted. Not a :class:`~ddl.DDLError`: the engine treats
    it as a local failure inside a collective and fails the job on every rank."""


def module() -> Any:
    """``cupy.cuda.nccl``, or None when CuPy, a CUDA device or NCCL is missing."""
    global _nccl, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    if cuda.cupy() is not None:
                        from cupy.cuda import nccl
                        if getattr(nccl, "available", True):
                            nccl.get_version()
                            _nccl = nccl
                except Exception:   # no NCCL library, or one CuPy cannot load
                    _nccl = None
                _tried = True
    return _nccl


def available() -> bool:
    """Whether this process can use NCCL (CuPy with a CUDA device and an NCCL library)."""
    return module() is not None


def version() -> int:
    """NCCL's version code (e.g. 22809 for 2.28.9); 0 when it is not available."""
    nccl = module()
    return int(nccl.get_version()) if nccl is not None else 0


def unique_id() -> np.ndarray:
    """A new communicator id, as the bytes the members' first rank hands to the others."""
    raw = module().get_unique_id()
    return np.array([b & 0xFF for b in raw], dtype=np.uint8)


class NcclComm:
    """This rank's member ``index`` of a communicator of ``size`` members on ``device``,
    from the ``uid`` bytes of :func:`unique_id` (the same on every member).

    :meth:`connect` joins it. ``ranks`` (the members' global ranks) name them in errors;
    ``abort_check`` is the job's. Cross-rank contract of every collective: the host paths'
    (:mod:`ddl.dataplane.algorithms.shm_collectives`), on 1-D contiguous CuPy arrays on
    ``device``. One collective at a time (the executor's thread)."""

    def __init__(self, uid: np.ndarray, size: int, index: int, device: int,
                 ranks: Sequence[int], abort_check: Callable[[], None]):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL: a unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self._uid = bytes(np.asarray(uid, dtype=np.uint8))
        self.size, self.index, self.device = size, index, device
        self.ranks = tuple(ranks)
        self._abort_check = abort_check
        self._comm: Any = None
        self._error: Optional[BaseException] = None
        self._calls: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._aborting = threading.Lock()   # one ncclCommAbort per communicator

    @property
    def rank(self) -> int:
        return self.ranks[self.index]

    # -- the host thread that calls NCCL ------------------------------------------------
    def _serve(self) -> None:
        try:
            device = cuda.cupy().cuda.Device(self.device)
            device.use()
        except BaseException as exc:   # every call fails with it
            device, setup = None, exc
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, done, out = item
            try:
                if device is None:
                    raise setup
                value = fn()
                if out.get("abandoned") and hasattr(value, "abort"):
                    value.abort()   # a communicator its caller gave up waiting for
                out["value"] = value
            except BaseException as exc:   # reported by the waiting thread
                out["error"] = exc
            done.set()

    def _call(self, fn: Callable[[], Any], deadline: float, what: str) -> Any:
        """``fn()`` in the communicator's thread; wait for it with the deadline and the
        job's abort check (see the module doc)."""
        if self._error is not None:
            raise self._error
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ddl-nccl", daemon=True)
            self._thread.start()
        done, out = threading.Event(), {}
        self._calls.put((fn, done, out))
        try:
            while not done.wait(_CHECK_S):
                if not self._thread.is_alive():
                    self._fail(what, "the communicator's thread has ended")
                self._check(deadline, what)
        except BaseException:
            out["abandoned"] = True
            raise
        if "error" in out:
            exc = out["error"]
            self._fail(what, f"NCCL failed: {type(exc).__name__}: {describe(exc)}")
        return out.get("value")

    # -- joining ------------------------------------------------------------------------
    def connect(self, deadline: float) -> "NcclComm":
        """Join the communicator (``ncclCommInitRank`` returns once every member has
        joined), waiting with ``deadline`` and the job's abort check: a member that never
        joins makes this one raise :class:`NcclError` (the communicator's thread then
        stays in NCCL until the process ends, as one never made cannot be aborted)."""
        nccl = module()
        signed = tuple(b - 256 if b > 127 else b for b in self._uid)

        def join() -> Any:
            try:
                return nccl.NcclCommunicator(self.size, signed, self.index)
            except OverflowError:   # a platform whose C char is unsigned (aarch64)
                return nccl.NcclCommunicator(self.size, tuple(self._uid), self.index)

        self._comm = self._call(join, deadline, "init")
        return self

    # -- collectives --------------------------------------------------------------------
    def allreduce(self, buf, op: int, deadline: float, src=None) -> None:
        """``buf`` = the members' ``src`` (default ``buf``) reduced with ``op``."""
        source = buf if src is None else src
        if source.size != buf.size or source.dtype != buf.dtype:
            raise ValueError(f"NCCL allreduce: src is {source.dtype}[{source.size}] but buf "
                             f"is {buf.dtype}[{buf.size}]")
        code, nop = _TYPES.get(np.dtype(buf.dtype)), _op(buf.dtype, op)
        if code is None or (buf.dtype.kind == "f" and op in (ReduceOp.Min, ReduceOp.Max)):
            self._reduce_gathered(source, buf, op, deadline)
        elif buf.size:
            self._run(deadline, "allreduce", lambda c, s: c.allReduce(
                source.data.ptr, buf.data.ptr, buf.size, code, nop, s))

    def reducescatter(self, buf, counts: Sequence[int], op: int, deadline: float) -> None:
        """Member ``k``'s block of ``buf`` (``counts`` elements each, in member order)
        becomes that block reduced over the members; the other blocks are left undefined.
        One ``ncclReduce`` per block, grouped."""
        counts = check_counts(counts, self.size, "NCCL reducescatter")
        if sum(counts) != buf.size:
            raise ValueError(f"NCCL reducescatter: counts {counts} sum to {sum(counts)} "
                             f"elements but the buffer has {buf.size}")
        code, nop = _TYPES.get(np.dtype(buf.dtype)), _op(buf.dtype, op)
        blocks = offsets(counts)
        if code is None or (buf.dtype.kind == "f" and op in (ReduceOp.Min, ReduceOp.Max)):
            whole = buf.copy()
            self._reduce_gathered(whole, whole, op, deadline)
            lo, hi = blocks[self.index], blocks[self.index + 1]
            buf[lo:hi] = whole[lo:hi]
            return
        size = buf.dtype.itemsize

        def run(c, s):
            for k, n in enumerate(counts):
                if n:
                    at = buf.data.ptr + blocks[k] * size
                    c.reduce(at, at, n, code, nop, k, s)
        self._run(deadline, "reducescatter", run, grouped=True)

    def allgatherv(self, send, out, counts: Sequence[int], deadline: float) -> None:
        """Every member's ``send`` bytes (``counts[k]`` from member ``k``), in member
        order, into ``out`` (uint8). Equal counts: one ``ncclAllGather``; else one
        ``ncclBroadcast`` per member, grouped."""
        counts = check_counts(counts, self.size, "NCCL allgather")
        if sum(counts) != out.nbytes or counts[self.index] != send.nbytes:
            raise ValueError(f"NCCL allgather: counts {counts} do not fit {send.nbytes} bytes "
                             f"sent by member {self.index} and {out.nbytes} gathered")
        if len(set(counts)) == 1:
            if counts[0]:
                self._run(deadline, "allgather", lambda c, s: c.allGather(
                    send.data.ptr, out.data.ptr, counts[0], _U8, s))
            return
        starts = offsets(counts)

        def run(c, s):
            for k, n in enumerate(counts):
                if n:
                    where = out.data.ptr + starts[k]
                    _broadcast(c, send.data.ptr if k == self.index else where, where, n,
                               k, s)
        self._run(deadline, "allgather", run, grouped=True)

    def broadcast(self, buf, root: int, deadline: float, src=None) -> None:
        """``buf`` (uint8) = member ``root``'s ``src`` (default its ``buf``)."""
        source = buf if src is None else src
        if source.nbytes != buf.nbytes:
            raise ValueError(f"NCCL broadcast: src has {source.nbytes} bytes, buf "
                             f"{buf.nbytes}")
        if buf.nbytes:
            pieces = broadcast_pieces(buf.nbytes)
            self._run(deadline, "broadcast", lambda c, s: _broadcast(
                c, source.data.ptr, buf.data.ptr, buf.nbytes, root, s),
                grouped=len(pieces) > 1)

    def alltoallv(self, send, send_counts: Sequence[int], recv, recv_counts: Sequence[int],
                  deadline: float) -> None:
        """Member ``k`` gets ``send_counts[k]`` bytes of ``send`` (in member order) and
        ``recv`` holds ``recv_counts[k]`` bytes from each member ``k``: grouped sends and
        receives."""
        send_counts = check_counts(send_counts, self.size, "NCCL alltoall")
        recv_counts = check_counts(recv_counts, self.size, "NCCL alltoall")
        if sum(send_counts) != send.nbytes or sum(recv_counts) != recv.nbytes:
            raise ValueError(f"NCCL alltoall: send counts {send_counts} for {send.nbytes} "
                             f"bytes, receive counts {recv_counts} for {recv.nbytes}")
        out_at, in_at = offsets(send_counts), offsets(recv_counts)

        def run(c, s):
            for k in range(self.size):
                if send_counts[k]:
                    c.send(send.data.ptr + out_at[k], send_counts[k], _U8, k, s)
                if recv_counts[k]:
                    c.recv(recv.data.ptr + in_at[k], recv_counts[k], _U8, k, s)
        self._run(deadline, "alltoall", run, grouped=True)

    def _reduce_gathered(self, source, out, op: int, deadline: float) -> None:
        """``out`` = every member's ``source`` reduced in member order (bitwise the same
        everywhere, NaNs kept), from an allgather of the bytes (memory: ``size`` times the
        buffer)."""
        fn = reduce_ufunc(out.dtype, op)
        if not source.size:
            return
        every = _cupy().empty(self.size * source.size, dtype=source.dtype)
        self.allgatherv(source.view(np.uint8), every.view(np.uint8),
                        [source.nbytes] * self.size, deadline)
        parts = [every[k * source.size:(k + 1) * source.size] for k in range(self.size)]
        if len(parts) == 1:
            out[...] = parts[0]
            return
        fn(parts[0], parts[1], out=out)
        for part in parts[2:]:
            fn(out, part, out=out)

    # -- queueing, waiting, failing -----------------------------------------------------
    def _run(self, deadline: float, what: str, queue_on: Callable[[Any, int], None],
             grouped: bool = False) -> None:
        if self._error is not None:
            raise self._error
        if self._comm is None:
            raise RuntimeError("NCCL: call NcclComm.connect() first")
        if _faults.ACTIVE is not None: _faults.hit("nccl.call")
        stream, comm, nccl = _cupy().cuda.get_current_stream(), self._comm, module()
        if stream.ptr == cuda.PER_THREAD_STREAM:   # another stream in the communicator's thread
            raise ValueError("NCCL: the current stream is CUDA's per-thread default stream; "
                             "the device data plane queues on a stream of its own")

        def queue_call() -> None:
            if not grouped:
                queue_on(comm, stream.ptr)
                return
            nccl.groupStart()
            try:
                queue_on(comm, stream.ptr)
            finally:
                nccl.groupEnd()
        self._call(queue_call, deadline, what)
        self.wait(stream, deadline, what)

    def wait(self, stream, deadline: float, what: str) -> None:
        """Wait on the host until the work queued on ``stream`` is done; on NCCL's
        asynchronous error, the job's fatal error or the deadline, abort and raise."""
        if self._error is not None:
            raise self._error
        event = cuda.record_on(stream)
        spins, next_check = 0, 0.0
        while not event.done:
            spins += 1
            if spins <= 200:
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_S
                self._check(deadline, what)
                try:
                    self._comm.check_async_error()
                except Exception as exc:
                    self._fail(what, f"NCCL reported an error: {describe(exc)}")
            time.sleep(2e-5 if spins < 2000 else 2e-4)

    def _check(self, deadline: float, what: str) -> None:
        """Raise (aborting) if the job failed or ``deadline`` has passed."""
        try:
            self._abort_check()
        except BaseException as exc:
            self._abort()
            self._error = exc
            raise
        if time.monotonic() >= deadline:
            self._fail(what, f"ranks {list(self.ranks)} did not finish it before the "
                             f"deadline (a peer that never came, or froze)")

    def _fail(self, what: str, why: str) -> None:
        """Abort, then raise: the job's own error if it names one within
        ``_CAUSE_WAIT_S`` (an NCCL failure is most often a peer's: it died, or aborted its
        communicator because the job failed, and the job then names that peer, as it does
        for a broken connection of the host paths), else :class:`NcclError`."""
        err = NcclError(f"NCCL {what} on rank {self.rank} (cuda:{self.device}, among ranks "
                        f"{list(self.ranks)}): {why}; the communicator was aborted (with "
                        f"DDL_NCCL=off on every rank, such device arrays are staged through "
                        f"host memory instead)")
        self._abort()
        self._error = self._job_error(time.monotonic() + _CAUSE_WAIT_S) or err
        if self._error is err:
            raise err
        raise self._error from err

    def _job_error(self, until: float) -> Optional[BaseException]:
        """What the job's abort check raises, polled until ``until``; None if nothing."""
        while True:
            try:
                self._abort_check()
            except BaseException as exc:
                return exc
            if time.monotonic() >= until:
                return None
            time.sleep(0.01)

    def _abort(self) -> None:
        """``ncclCommAbort``, in a thread of its own (it may wait for the peers' aborts)
        and for at most ``_ABORT_WAIT_S``; then the communicator's thread ends."""
        with self._aborting:
            comm, self._comm = self._comm, None
        if comm is not None:
            def abort() -> None:
                try:
                    with _cupy().cuda.Device(self.device):
                        comm.abort()
                except Exception:   # already torn down: nothing more to end
                    pass
            ender = threading.Thread(target=abort, name="ddl-nccl-abort", daemon=True)
            ender.start()
            ender.join(_ABORT_WAIT_S)
        if self._thread is not None:
            self._calls.put(None)

    def close(self) -> None:
        """Release the communicator (idempotent): aborted rather than destroyed, since
        ``ncclCommDestroy`` waits for every member to destroy theirs. A call still inside
        NCCL in the communicator's thread (one whose caller gave up) is ended by the abort,
        as torch's watchdog ends one."""
        if self._error is None:
            self._error = RuntimeError("NCCL: the communicator is closed")
        self._abort()


def _op(dtype, op: int) -> int:
    """NCCL's operation for ``op`` on ``dtype``; the host paths' ValueError where ``op`` is
    not defined there (bool: Min and Max only)."""
    reduce_ufunc(dtype, op)   # raises, naming the op, where it is not defined
    code = _OPS.get(ReduceOp(op))
    if code is None:
        raise ValueError(f"NCCL: reduce op {ReduceOp(op).name} has no NCCL operation")
    return code


def _cupy() -> Any:
    return cuda.cupy()
