"""A stand-in for CuPy's NCCL binding (``cupy.cuda.nccl``), for tests on machines without a
GPU. It is NOT NCCL and runs no device code.

"Device memory" is ordinary process memory addressed by integer pointers. Every call works
synchronously at call time (after what ``stream`` holds, where the stand-in's streams are
lazy) and moves the bytes between the members,
which may be separate processes on this machine, through files in /dev/shm (the temporary
directory where there is none), all named ``ddl-standin-nccl-<session>-<id>...``
(``<session>``: the test session's name, ``DDLTEST_SESSION``; ``<id>``: a hash of the
unique id):

* ``<base>``: the header, mapped by every member: ndev, joined and left counts, an aborted
  flag, which members joined, and each member's barrier phase;
* ``<base>-c<seq>-<member>``: a member's contribution to its ``seq``-th collective (written,
  barrier, read by whoever needs it, barrier, removed by its writer);
* ``<base>-p<src>-<dst>-<n>``: the ``n``-th message from ``src`` to ``dst`` (the receiver
  removes it; the sender's group ends once it is gone).

Results of reductions are computed in member order (``out = op(out, member k)``), so they
are bitwise equal on every member. Zero-count calls are no-ops (ddl never issues them).
Every wait polls with short sleeps and ends with :class:`NcclError` when the communicator
was aborted or destroyed (in any thread), a member aborted, or after
``DDL_TEST_NCCL_TIMEOUT`` seconds (default 120; a timeout also aborts the peers). The
last member to leave removes the header and any leftover files.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import hashlib
import itertools
import mmap
import os
import tempfile
import threading
import time

import numpy as np

available = True
_VERSION = 22809
_ID_BYTES = 128
# with the test session's name (tests/conftest.py), so that a session removes only its own
_PREFIX = "ddl-standin-nccl-" + os.environ.get("DDLTEST_SESSION", "") + "-"
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

# ncclDataType_t and ncclRedOp_t, as in nccl.h
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
_INT_MAX = 2 ** 31 - 1
_DTYPES = [np.dtype(t) for t in (np.int8, np.uint8, np.int32, np.uint32, np.int64,
                                 np.uint64, np.float16, np.float32, np.float64)]
_OPS = [np.add, np.multiply, np.fmax, np.fmin]   # fmax/fmin: NCCL's fmaxf/fminf drop NaNs

# the statuses CuPy's NcclError knows (its ERROR2); for any other, such as 6
# (ncclRemoteError, what a dead peer causes), constructing it raises KeyError(status), as
# CuPy's does (cupy/cupy#8661)
_STATUS = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
           3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
           5: "NCCL_ERROR_INVALID_USAGE"}

# header layout (int64 slots); then `present` and `phase`, ndev slots each
_NDEV, _JOINED, _LEFT, _ABORTED, _FIXED = 0, 1, 2, 3, 4


class NcclError(RuntimeError):
    """An NCCL error ``status`` (ncclResult_t), as CuPy raises it."""

    def __init__(self, status: int, msg: str = ""):
        self.status = int(status)
        self._msg = msg
        name = _STATUS[self.status]
        super().__init__(f"{name}: {msg}" if msg else name)

    def __reduce__(self):
        return NcclError, (self.status, self._msg)


def get_version() -> int:
    return _VERSION


def get_build_version() -> int:
    return _VERSION


def get_unique_id() -> tuple:
    """128 random signed chars, as CuPy returns ``ncclUniqueId``."""
    return tuple(b - 256 if b > 127 else b for b in os.urandom(_ID_BYTES))


_tls = threading.local()   # this thread's group: nesting depth and queued calls


def groupStart() -> None:
    _tls.depth = getattr(_tls, "depth", 0) + 1
    if _tls.depth == 1:
        _tls.queue = []


def groupEnd() -> None:
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        raise NcclError(5, "groupEnd without groupStart")
    _tls.depth = depth - 1
    if depth == 1:
        items, _tls.queue = _tls.queue, []
        _execute(items)


def _execute(items: list) -> None:
    """Run queued calls in order; each run of consecutive sends and receives is one
    exchange (every send posted first, so no pattern deadlocks)."""
    for collective, run in itertools.groupby(items, lambda item: item[1] == "coll"):
        if not collective:
            _exchange(list(run))
            continue
        for comm, _, call in run:
            comm._usable()
            call()


def _exchange(run: list) -> None:
    posted = []
    try:
        for comm, kind, (peer, ptr, nbytes) in run:
            if kind == "send":
                comm._usable()
                posted.append((comm, peer, comm._post(peer, ptr, nbytes)))
        for comm, kind, (peer, ptr, nbytes) in run:
            if kind == "recv":
                comm._usable()
                comm._take(peer, ptr, nbytes)
        for comm, peer, path in posted:   # a send completes once its peer has taken it
            comm._wait(lambda: not os.path.exists(path), f"send to member {peer}")
    finally:
        for comm, _, path in posted:
            comm._discard(path)


def _flush(stream) -> None:
    """What the stream holds before this call runs first (the stand-in's lazy streams,
    ``DDL_TEST_LAZY_STREAMS``: an NCCL call here runs at once, in stream order)."""
    try:
        from . import flush_stream
    except ImportError:   # used on its own, without the stand-in's cupy.cuda
        return
    flush_stream(int(stream))


def _mem(ptr: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes at address ``ptr``, as a writable uint8 array."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(int(ptr)))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NcclCommunicator:
    """Member ``rank`` of the ``ndev`` members of communicator ``commId``; the constructor
    returns once every member has joined."""

    def __init__(self, ndev: int, commId: tuple, rank: int):
        self._left = self._closed = False
        self._hdr = None
        raw = [int(b) for b in commId]
        if len(raw) != _ID_BYTES:
            raise ValueError(f"a unique id has {_ID_BYTES} bytes, got {len(raw)}")
        if any(b < -128 or b > 255 for b in raw):
            raise OverflowError("a unique id byte is out of range")
        ndev, rank = int(ndev), int(rank)
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(4, f"rank {rank} of {ndev} members")
        self._ndev, self._rank = ndev, rank
        self._timeout = float(os.environ.get("DDL_TEST_NCCL_TIMEOUT", "120"))
        digest = hashlib.blake2b(bytes(b & 0xFF for b in raw), digest_size=16).hexdigest()
        self._base = os.path.join(_DIR, _PREFIX + digest)
        self._error = None
        self._seq = self._phase = 0
        self._sent, self._got = [0] * ndev, [0] * ndev
        self._mine: set = set()   # this member's files
        self._lock = threading.Lock()
        self._join()
        try:
            self._wait(lambda: self._hdr[_JOINED] >= ndev, "init (waiting for the members)")
        except BaseException:
            self._leave(abort=True)
            raise

    # -- joining and leaving ----------------------------------------------------------
    def _join(self) -> None:
        size = 8 * (_FIXED + 2 * self._ndev)
        fd = os.open(self._base, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._ino = os.fstat(fd).st_ino
            hdr = np.frombuffer(mmap.mmap(fd, size), np.int64)
            if hdr[_NDEV] not in (0, self._ndev):
                raise NcclError(4, f"the communicator has {hdr[_NDEV]} members, not {self._ndev}")
            if hdr[_FIXED + self._rank]:
                raise NcclError(4, f"member {self._rank} has already joined")
            hdr[_NDEV] = self._ndev
            hdr[_FIXED + self._rank] = 1
            hdr[_JOINED] += 1
            self._hdr = hdr   # never unmapped: a wait in another thread may still read it
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)   # explicitly: the mapping holds a dup of fd
            os.close(fd)

    def _leave(self, abort: bool) -> None:
        with self._lock:
            if self._left:
                return
            self._left = self._closed = True
        hdr = self._hdr
        if hdr is None:
            return
        if abort:
            hdr[_ABORTED] = 1
        for path in self._mine.copy():
            _unlink(path)
        try:
            fd = os.open(self._base, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            if os.fstat(fd).st_ino != self._ino:   # a later communicator's header
                return
            fcntl.flock(fd, fcntl.LOCK_EX)
            hdr[_LEFT] += 1
            if hdr[_LEFT] >= hdr[_JOINED]:   # the last one out
                for path in glob.glob(glob.escape(self._base) + "-*"):
                    _unlink(path)
                _unlink(self._base)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def abort(self) -> None:
        """Leave at once and make every member's waits raise :class:`NcclError`."""
        self._leave(abort=True)

    def destroy(self) -> None:
        self._leave(abort=False)

    def __del__(self):
        try:
            self._leave(abort=False)
        except Exception:
            pass

    # -- state ------------------------------------------------------------------------
    def _usable(self) -> None:
        self._handle()
        if self._error is not None:
            raise self._error

    def check_async_error(self) -> None:
        self._usable()
        if self._hdr[_ABORTED]:
            raise NcclError(6, "a member aborted the communicator")

    def _handle(self) -> None:
        if self._closed:
            raise NcclError(5, "the communicator was destroyed or aborted")

    def rank_id(self) -> int:
        self._handle()
        return self._rank

    def size(self) -> int:
        self._handle()
        return self._ndev

    def device_id(self) -> int:
        self._handle()
        return 0

    def _fail(self, status: int, msg: str) -> None:
        try:
            self._error = NcclError(status, f"member {self._rank} of {self._ndev}: {msg}")
        except KeyError as exc:
            self._error = exc
        raise self._error

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self._timeout
        pause = 5e-5
        while not ready():
            if self._closed:
                raise NcclError(5, f"{what}: the communicator was destroyed or aborted")
            if self._hdr[_ABORTED] and not ready():   # a member may finish, then abort
                self._fail(6, f"{what}: a member aborted the communicator")
            if time.monotonic() >= deadline:
                self._hdr[_ABORTED] = 1
                self._fail(2, f"{what}: timed out after {self._timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _barrier(self, what: str) -> None:
        self._phase += 1
        n, phase = self._ndev, self._phase
        phases = self._hdr[_FIXED + n:_FIXED + 2 * n]
        phases[self._rank] = phase
        self._wait(lambda: bool((phases >= phase).all()), what)

    # -- files ------------------------------------------------------------------------
    def _write(self, path: str, ptr: int, nbytes: int) -> None:
        self._mine.add(path)
        with open(path, "wb") as f:
            f.write(_mem(ptr, nbytes))

    def _discard(self, path: str) -> None:
        _unlink(path)
        self._mine.discard(path)

    def _post(self, peer: int, ptr: int, nbytes: int) -> str:
        self._sent[peer] += 1
        path = f"{self._base}-p{self._rank}-{peer}-{self._sent[peer]}"
        self._write(path + ".tmp", ptr, nbytes)
        self._mine.add(path)
        os.rename(path + ".tmp", path)   # appears whole
        self._mine.discard(path + ".tmp")
        return path

    def _take(self, peer: int, ptr: int, nbytes: int) -> None:
        self._got[peer] += 1
        path = f"{self._base}-p{peer}-{self._rank}-{self._got[peer]}"
        self._wait(lambda: os.path.exists(path), f"recv from member {peer}")
        data = np.fromfile(path, np.uint8)
        _unlink(path)
        if data.size != nbytes:
            self._fail(4, f"recv of {nbytes} bytes from member {peer}, which sent {data.size}")
        _mem(ptr, nbytes)[...] = data

    # -- calls ------------------------------------------------------------------------
    def _submit(self, count: int, kind: str, what) -> None:
        self._usable()
        if int(count) < 0:
            raise NcclError(4, f"count {count}")
        if count == 0:
            return
        if getattr(_tls, "depth", 0):
            _tls.queue.append((self, kind, what))
        else:
            _execute([(self, kind, what)])

    def _collective(self, name: str, contribute, finish) -> None:
        """Write ``contribute`` ((ptr, nbytes) or None) to this member's file; after a
        barrier, ``finish(read)`` with ``read(member, dtype, count, offset_bytes)``."""
        self._seq += 1
        seq, mine = self._seq, f"{self._base}-c{self._seq}-{self._rank}"

        def read(k, dtype, count, offset=0):
            return np.fromfile(f"{self._base}-c{seq}-{k}", dtype, count, offset=offset)
        try:
            if contribute is not None:
                self._write(mine, *contribute)
            self._barrier(name)
            finish(read)
            self._barrier(name)
        finally:
            self._discard(mine)

    def _reduce_all(self, read, fn, dtype, count, offset=0) -> np.ndarray:
        out = read(0, dtype, count, offset)
        for k in range(1, self._ndev):
            fn(out, read(k, dtype, count, offset), out=out)
        return out

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        _flush(stream)
        dtype, fn = _dtype(datatype), _op(op)

        def finish(read):
            _mem(recvbuf, count * dtype.itemsize).view(dtype)[...] = \
                self._reduce_all(read, fn, dtype, count)
        self._submit(count, "coll", lambda: self._collective(
            "allReduce", (sendbuf, count * dtype.itemsize), finish))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        _flush(stream)
        dtype, fn, root = _dtype(datatype), _op(op), self._member(root)

        def finish(read):
            if self._rank == root:
                _mem(recvbuf, count * dtype.itemsize).view(dtype)[...] = \
                    self._reduce_all(read, fn, dtype, count)
        self._submit(count, "coll", lambda: self._collective(
            "reduce", (sendbuf, count * dtype.itemsize), finish))

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        if not 0 <= count <= _INT_MAX:   # CuPy before 13.4 takes broadcast's count as int
            raise OverflowError(f"value too large to convert to int: {count}")
        _flush(stream)
        nbytes, root = count * _dtype(datatype).itemsize, self._member(root)

        def finish(read):
            if self._rank != root or sendbuff != recvbuff:
                _mem(recvbuff, nbytes)[...] = read(root, np.uint8, nbytes)
        self._submit(count, "coll", lambda: self._collective(
            "broadcast", (sendbuff, nbytes) if self._rank == root else None, finish))

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        _flush(stream)
        nbytes = count * _dtype(datatype).itemsize

        def finish(read):
            out = _mem(recvbuf, self._ndev * nbytes)
            for k in range(self._ndev):
                out[k * nbytes:(k + 1) * nbytes] = read(k, np.uint8, nbytes)
        self._submit(count, "coll", lambda: self._collective(
            "allGather", (sendbuf, nbytes), finish))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        _flush(stream)
        dtype, fn = _dtype(datatype), _op(op)
        nbytes = recvcount * dtype.itemsize

        def finish(read):
            _mem(recvbuf, nbytes).view(dtype)[...] = \
                self._reduce_all(read, fn, dtype, recvcount, self._rank * nbytes)
        self._submit(recvcount, "coll", lambda: self._collective(
            "reduceScatter", (sendbuf, self._ndev * nbytes), finish))

    def send(self, sendbuf, count, datatype, peer, stream):
        _flush(stream)
        nbytes = count * _dtype(datatype).itemsize
        self._submit(count, "send", (self._member(peer), sendbuf, nbytes))

    def recv(self, recvbuf, count, datatype, peer, stream):
        _flush(stream)
        nbytes = count * _dtype(datatype).itemsize
        self._submit(count, "recv", (self._member(peer), recvbuf, nbytes))

    def _member(self, k) -> int:
        if not 0 <= int(k) < self._ndev:
            raise NcclError(4, f"member {k} of {self._ndev}")
        return int(k)


def _dtype(code) -> np.dtype:
    if not 0 <= int(code) < len(_DTYPES):
        raise NcclError(4, f"datatype {code}")
    return _DTYPES[int(code)]


def _op(code):
    if not 0 <= int(code) < len(_OPS):
        raise NcclError(4, f"reduction op {code}")
    return _OPS[int(code)]
