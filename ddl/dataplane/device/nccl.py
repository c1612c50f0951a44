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
in one communicator.

Every collective is queued on the current CUDA stream (the data plane's), then the host
waits for it (:meth:`NcclComm.wait`): it polls an event on that stream, NCCL's asynchronous
error and the job's abort check, and gives up at the deadline. A failure aborts the
communicator (``ncclCommAbort`` ends this rank's NCCL kernels, so nothing keeps waiting on
the GPU) and breaks it: every later call raises the same error. The members' NCCL kernels
then fail too, each rank's wait ending by its own abort check (the job's fatal error) or
its deadline.

Reductions combine in NCCL's order, the same bits on every member (NCCL's rings and trees
hand every member the bytes that one reduction produced); dtypes NCCL has no type for
(int16, uint16) are gathered and reduced in member order on the device instead.

CuPy and NCCL are imported on first use; :func:`available` says whether they load.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ddl.core.dtypes import ReduceOp
from ddl.core.errors import DDLTimeoutError, PeerLostError
from ddl.dataplane.algorithms._buffers import offsets
from ddl.dataplane.algorithms._reduce import reduce_ufunc

# ncclDataType_t and ncclRedOp_t: NCCL's public ABI (nccl.h), the same in every NCCL 2.x
_TYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.bool_): 1,
          np.dtype(np.int32): 2, np.dtype(np.uint32): 3, np.dtype(np.int64): 4,
          np.dtype(np.uint64): 5, np.dtype(np.float16): 6, np.dtype(np.float32): 7,
          np.dtype(np.float64): 8}
_OPS = {ReduceOp.Sum: 0, ReduceOp.Product: 1, ReduceOp.Max: 2, ReduceOp.Min: 3}
UNIQUE_ID_BYTES = 128
_CHECK_S = 0.05   # how often a wait asks NCCL and the job whether something failed

_lock = threading.Lock()
_nccl: Any = None
_tried = False


def module() -> Any:
    """``cupy.cuda.nccl``, or None when CuPy, a CUDA device or NCCL is missing."""
    global _nccl, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    from ddl.dataplane.device import cuda
                    if cuda.cupy() is not None:
                        from cupy.cuda import nccl
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

    Joining waits for every member; :meth:`connect` does it with a deadline and the job's
    ``abort_check``. ``ranks`` (the members' global ranks) name peers in errors. One
    collective at a time (the executor's thread)."""

    def __init__(self, uid: np.ndarray, size: int, index: int, device: int,
                 ranks: Sequence[int], abort_check: Callable[[], None]):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL: a unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self._uid = tuple(int(b) - 256 if b > 127 else int(b) for b in np.asarray(uid))
        self.size, self.index, self.device = size, index, device
        self.ranks = tuple(ranks)
        self._abort_check = abort_check
        self._comm: Any = None
        self._error: Optional[BaseException] = None

    # -- joining ------------------------------------------------------------------------
    def connect(self, deadline: float) -> "NcclComm":
        """Join the communicator (``ncclCommInitRank``, which returns once every member
        has joined). It runs in a helper thread, so that a member that never joins makes
        this one raise :class:`~ddl.DDLTimeoutError` at ``deadline`` (or the job's fatal
        error) instead of waiting for ever; that thread then stays blocked in NCCL until
        the process ends, since a communicator that was never made cannot be aborted."""
        nccl, result = module(), {}

        def join() -> None:
            try:
                from ddl.dataplane.device import cuda
                with cuda.cupy().cuda.Device(self.device):
                    result["comm"] = nccl.NcclCommunicator(self.size, self._uid, self.index)
            except BaseException as exc:   # reported by the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=join, name="ddl-nccl-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_CHECK_S)
            if not thread.is_alive():
                break
            self._abort_check()
            if time.monotonic() >= deadline:
                raise DDLTimeoutError(
                    f"NCCL: rank {self.ranks[self.index]} waited past its deadline for "
                    f"ranks {list(self.ranks)} to join a communicator on cuda:{self.device}",
                    op="nccl init", cause="init")
        if "error" in result:
            raise PeerLostError(f"NCCL: rank {self.ranks[self.index]} could not join the "
                                f"communicator of ranks {list(self.ranks)} on cuda:"
                                f"{self.device}: {result['error']}",
                                rank=self.ranks[self.index], cause="nccl init") \
                from result["error"]
        self._comm = result["comm"]
        return self

    # -- collectives (queued on the current stream; then wait) ---------------------------
    def allreduce(self, buf, op: int, deadline: float, src=None) -> None:
        """``buf`` = the members' ``src`` (default ``buf``) reduced with ``op``."""
        source = buf if src is None else src
        code = _TYPES.get(np.dtype(buf.dtype))
        if code is None:   # no NCCL type: gather every member's and reduce in member order
            self._reduce_gathered(source, buf, op, deadline)
            return
        self._run(deadline, "allreduce", lambda c, s: c.allReduce(
            source.data.ptr, buf.data.ptr, buf.size, code, _op(buf.dtype, op), s))

    def reducescatter(self, buf, counts: Sequence[int], op: int, deadline: float) -> None:
        """Member ``k``'s block of ``buf`` (``counts`` elements each, in member order)
        becomes that block reduced over the members; the other blocks are left as they
        are. One ``ncclReduce`` per block, grouped."""
        code = _TYPES.get(np.dtype(buf.dtype))
        blocks = offsets(counts)
        if code is None:
            mine = buf[blocks[self.index]:blocks[self.index + 1]]
            whole = buf.copy()
            self._reduce_gathered(whole, whole, op, deadline)
            mine[...] = whole[blocks[self.index]:blocks[self.index + 1]]
            return
        size, nop = buf.dtype.itemsize, _op(buf.dtype, op)

        def run(c, s):
            nccl = module()
            nccl.groupStart()
            try:
                for k, n in enumerate(counts):
                    if n:
                        at = buf.data.ptr + blocks[k] * size
                        c.reduce(at, at, n, code, nop, k, s)
            finally:
                nccl.groupEnd()
        self._run(deadline, "reducescatter", run)

    def allgatherv(self, send, out, counts: Sequence[int], deadline: float) -> None:
        """Every member's ``send`` bytes (``counts[k]`` from member ``k``), in member
        order, into ``out`` (uint8). Equal counts: one ``ncclAllGather``; else one
        ``ncclBroadcast`` per member, grouped."""
        if len(set(counts)) == 1:
            if counts[0]:
                self._run(deadline, "allgather", lambda c, s: c.allGather(
                    send.data.ptr, out.data.ptr, counts[0], 1, s))
            return
        starts = offsets(counts)

        def run(c, s):
            nccl = module()
            nccl.groupStart()
            try:
                for k, n in enumerate(counts):
                    if n:
                        where = out.data.ptr + starts[k]
                        c.broadcast(send.data.ptr if k == self.index else where, where, n,
                                    1, k, s)
            finally:
                nccl.groupEnd()
        self._run(deadline, "allgather", run)

    def broadcast(self, buf, root: int, deadline: float, src=None) -> None:
        """``buf`` (uint8) = member ``root``'s ``src`` (default its ``buf``)."""
        if buf.nbytes:
            source = buf if src is None else src
            self._run(deadline, "broadcast", lambda c, s: c.broadcast(
                source.data.ptr, buf.data.ptr, buf.nbytes, 1, root, s))

    def alltoallv(self, send, send_counts: Sequence[int], recv, recv_counts: Sequence[int],
                  deadline: float) -> None:
        """Member ``k`` gets ``send_counts[k]`` bytes of ``send`` (in member order) and
        ``recv`` holds ``recv_counts[k]`` bytes from each member ``k``: grouped sends and
        receives."""
        out_at, in_at = offsets(send_counts), offsets(recv_counts)

        def run(c, s):
            nccl = module()
            nccl.groupStart()
            try:
                for k in range(self.size):
                    if send_counts[k]:
                        c.send(send.data.ptr + out_at[k], send_counts[k], 1, k, s)
                    if recv_counts[k]:
                        c.recv(recv.data.ptr + in_at[k], recv_counts[k], 1, k, s)
            finally:
                nccl.groupEnd()
        self._run(deadline, "alltoall", run)

    def _reduce_gathered(self, source, out, op: int, deadline: float) -> None:
        """``out`` = every member's ``source`` reduced in member order (bitwise the same
        everywhere), from an allgather of the bytes: for dtypes NCCL has no type for."""
        fn = reduce_ufunc(out.dtype, op)
        cp = _cupy()
        every = cp.empty(self.size * source.size, dtype=source.dtype)
        self.allgatherv(source.view(np.uint8), every.view(np.uint8),
                        [source.nbytes] * self.size, deadline)
        parts = [every[k * source.size:(k + 1) * source.size] for k in range(self.size)]
        if len(parts) == 1:
            out[...] = parts[0]
            return
        fn(parts[0], parts[1], out=out)
        for part in parts[2:]:
            fn(out, part, out=out)

    # -- waiting and failing --------------------------------------------------------------
    def _run(self, deadline: float, what: str, queue: Callable[[Any, int], None]) -> None:
        if self._error is not None:
            raise self._error
        if self._comm is None:
            raise RuntimeError("NCCL: call NcclComm.connect() first")
        stream = _cupy().cuda.get_current_stream()
        try:
            queue(self._comm, stream.ptr)
        except Exception as exc:
            self._fail(what, f"NCCL refused the call: {exc}", exc)
        self.wait(stream, deadline, what)

    def wait(self, stream, deadline: float, what: str) -> None:
        """Wait on the host until the work queued on ``stream`` is done; on NCCL's
        asynchronous error, the job's fatal error or the deadline, abort and raise."""
        cp = _cupy()
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        spins, next_check = 0, 0.0
        while not event.done:
            spins += 1
            if spins <= 200:
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_S
                try:
                    self._comm.check_async_error()
                except Exception as exc:
                    self._fail(what, f"NCCL reported an error: {exc}", exc)
                try:
                    self._abort_check()
                except BaseException as exc:
                    self._abort()
                    self._error = exc
                    raise
            if now >= deadline:
                err = DDLTimeoutError(
                    f"NCCL {what} on rank {self.ranks[self.index]}: the members "
                    f"{list(self.ranks)} did not finish it before the deadline; the "
                    f"communicator was aborted", op=what, cause="deadline")
                self._abort()
                self._error = err
                raise err
            time.sleep(2e-5 if spins < 2000 else 2e-4)

    def _fail(self, what: str, why: str, cause: BaseException) -> None:
        err = PeerLostError(f"NCCL {what} on rank {self.ranks[self.index]} among ranks "
                            f"{list(self.ranks)}: {why}", op=what, cause="nccl")
        self._abort()
        self._error = err
        raise err from cause

    def _abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:   # already torn down: nothing more to end
                pass

    def close(self) -> None:
        """Release the communicator (idempotent). A broken one was aborted already."""
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:
                pass
        if self._error is None:
            self._error = RuntimeError("NCCL: the communicator is closed")


def _op(dtype, op: int) -> int:
    code = _OPS.get(ReduceOp(op))
    if code is None or (np.dtype(dtype) == np.bool_ and op not in (ReduceOp.Min,
                                                                   ReduceOp.Max)):
        reduce_ufunc(dtype, op)   # raises the host paths' ValueError, naming the op
        raise ValueError(f"NCCL: reduce op {ReduceOp(op).name} has no NCCL operation")
    return code


def _cupy() -> Any:
    from ddl.dataplane.device import cuda
    return cuda.cupy()
