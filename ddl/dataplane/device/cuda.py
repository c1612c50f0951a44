"""CuPy, the device library of the data plane: device views, streams, events, results.

A framework's CUDA array reaches a collective as a :class:`DeviceArray`: a CuPy view of
its memory (no copy; bfloat16 as int16, since CuPy has no bfloat16), its logical dtype
and shape, and an event recorded on the caller's stream when it was submitted. The data
plane runs every device collective on its own stream per device (:func:`stream`), which
first waits for that event on the device, so the input is read only after the work that
produced it; a result is a :class:`DeviceArray` whose ``done`` event the caller's stream
waits for (:func:`hand_over`), again on the device. No call here synchronises the whole
device; the host waits only for the data plane's own stream, with a deadline
(:func:`settle`).

CuPy is imported on first use (``import ddl`` never imports it). :func:`available` says
whether it can be; without it device arrays are staged through host memory.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ddl.core.dtypes import BFLOAT16
from ddl.core.errors import DDLTimeoutError

_lock = threading.Lock()
_cupy: Any = None
_tried = False
_streams: Dict[int, Any] = {}


def cupy() -> Any:
    """The CuPy module, or None when it cannot be imported or sees no CUDA device."""
    global _cupy, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    import cupy as cp
                    if cp.cuda.runtime.getDeviceCount() < 1:
                        cp = None
                except Exception:   # not installed, no driver, no device
                    cp = None
                _cupy, _tried = cp, True
    return _cupy


def available() -> bool:
    """Whether device arrays can stay on the device (CuPy and a CUDA device)."""
    return cupy() is not None


class DeviceArray:
    """A contiguous device array as the data plane moves it.

    ``data``: a 1-D or shaped CuPy array over the bytes (bfloat16 as int16); ``dtype``
    and ``shape``: what the caller passed or gets back; ``device``: the CUDA device index;
    ``event``: for an input, recorded on the caller's stream ``caller`` at submission
    (None: ready); for a result, recorded on the data plane's stream once it is
    written."""

    __slots__ = ("data", "dtype", "shape", "device", "event", "owner", "caller")

    def __init__(self, data: Any, dtype: np.dtype, shape: Tuple[int, ...], device: int,
                 event: Any = None, owner: Any = None, caller: int = 0):
        self.data = data
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.device = int(device)
        self.event = event
        self.owner = owner   # what keeps the memory alive (the caller's tensor)
        self.caller = int(caller)   # an input's: the caller's stream (its handle)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def flat(self) -> Any:
        """The data as a 1-D CuPy array of the logical dtype's item size."""
        return self.data.reshape(-1)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}{list(self.shape)}, cuda:{self.device})"


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The CuPy dtype that holds ``dtype``'s bytes (bfloat16: int16)."""
    return np.dtype(np.int16) if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype)


def view(pointer: int, dtype: np.dtype, shape: Tuple[int, ...], device: int,
         owner: Any) -> Any:
    """A CuPy array over ``pointer`` (contiguous, ``dtype``'s storage), kept alive by
    ``owner``; no copy and no synchronisation."""
    cp = cupy()
    store = storage_dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * store.itemsize
    mem = cp.cuda.UnownedMemory(int(pointer), nbytes, owner, int(device))
    return cp.ndarray(tuple(shape), store, cp.cuda.MemoryPointer(mem, 0))


def stream(device: int) -> Any:
    """The data plane's stream on ``device`` (made once, non-blocking)."""
    found = _streams.get(device)
    if found is None:
        cp = cupy()
        with _lock:
            found = _streams.get(device)
            if found is None:
                with cp.cuda.Device(device):
                    found = _streams[device] = cp.cuda.Stream(non_blocking=True)
    return found


def record(stream_ptr: int, device: int) -> Any:
    """An event recorded now on the stream whose handle is ``stream_ptr`` (a caller's)."""
    cp = cupy()
    with cp.cuda.Device(device):
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(cp.cuda.ExternalStream(int(stream_ptr), device))
    return event


def wrap_input(pointer: int, dtype: np.dtype, shape: Tuple[int, ...], device: int,
               owner: Any, stream_ptr: int) -> DeviceArray:
    """A caller's contiguous device array as a :class:`DeviceArray`, ready once the
    caller's stream ``stream_ptr`` reaches this point."""
    data = view(pointer, dtype, shape, device, owner)
    return DeviceArray(data, dtype, shape, device, record(stream_ptr, device), owner,
                       stream_ptr)


class _Release:
    """The owner of a result's memory as the caller holds it (:func:`released_after`).
    When the caller drops the last view, an event is recorded on the caller's stream and
    the memory (``base``, with ``keep``, the call's inputs) waits in :data:`_released`
    until that event is reached: CuPy's pool gives memory freed on the data plane's stream
    to its next allocation at once, and the caller's kernels may still read it. The data
    plane's stream never waits for the caller's (whose work may wait for anything)."""

    __slots__ = ("base", "caller", "device", "keep")

    def __init__(self, base: Any, caller: int, device: int, keep: Any):
        self.base, self.caller, self.device, self.keep = base, caller, device, keep

    def __del__(self):
        try:
            cp = _cupy
            with cp.cuda.Device(self.device):
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(cp.cuda.ExternalStream(across_threads(self.caller),
                                                    self.device))
        except Exception:   # (the interpreter is going: nothing will reuse the memory)
            return
        with _released_lock:
            _released.append((event, self.base, self.keep))


# (event, memory, inputs) of results their callers dropped, until the event is reached;
# _reclaim returns them to the pool. Appended to from whatever thread drops a result
# (a garbage collection may run inside _reclaim itself: hence the RLock and the swap)
_released: List[Tuple[Any, Any, Any]] = []
_released_lock = threading.RLock()


def _reclaim() -> None:
    """Give CuPy's pool the dropped results whose callers' streams are past the point
    where they were dropped (a host query of each event; none waits)."""
    global _released
    if not _released:
        return
    with _released_lock:
        taken, _released = _released, []
    later = [item for item in taken if not item[0].done]
    if later:
        with _released_lock:
            _released[:0] = later
    del taken, later   # the others' memory goes back to the pool here


def released_after(data: Any, caller: int, device: int, keep: Any) -> Any:
    """``data`` (a result on the data plane's stream, from :func:`empty`) as the array
    the caller gets: its memory returns to the pool only once the caller's stream
    ``caller`` has done what it queued before dropping it (:class:`_Release`). Work on
    another stream that reads a result must be done, or waited for by the caller's
    stream, before the caller drops it.

    ``keep`` (the call's inputs, and the caller's stream object where it has one, so
    that the stream outlives the result) lives as long as the result: the data plane's
    stream may still read an input after the call returns, until the result is ready,
    and an input freed sooner could be reused by the stream it was made on in the
    meantime."""
    return view(data.data.ptr, data.dtype, data.shape, device,
                _Release(data, caller, device, keep))


def hand_over(result: DeviceArray, stream_ptr: int) -> Any:
    """Make the caller's stream ``stream_ptr`` wait (on the device) until ``result`` is
    written; returns its data."""
    if result.event is not None:
        cp = cupy()
        # on the result's device: a default stream's handle means the current device's
        with cp.cuda.Device(result.device):
            cp.cuda.ExternalStream(across_threads(int(stream_ptr)),
                                   result.device).wait_event(result.event)
    return result.data


LEGACY_STREAM = 1   # cudaStreamLegacy: the legacy default stream, named from any thread
PER_THREAD_STREAM = 2   # cudaStreamPerThread: a different stream in every host thread


def across_threads(stream_ptr: int) -> int:
    """The stream handle that means the caller's stream ``stream_ptr`` from another host
    thread (the executor's, a garbage collection's), on the current device: itself, but
    CUDA's per-thread default stream (a CuPy caller's under
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) is another stream in every thread, so it
    becomes the legacy default stream, with which every blocking stream (the per-thread
    ones included) synchronises."""
    return LEGACY_STREAM if stream_ptr == PER_THREAD_STREAM else stream_ptr


def record_on(s: Any) -> Any:
    """An event recorded now on the CuPy stream ``s``, made on ``s``'s device (CUDA
    refuses to record an event of one device on another's stream, and the thread's
    current device may be any, e.g. at shutdown)."""
    cp = cupy()
    if s.device_id < 0:   # a default stream (Stream.null, .ptds): the current device's
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(s)
        return event
    with cp.cuda.Device(s.device_id):
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(s)
    return event


def settle(s: Any, deadline: float, what: str,
           check: Optional[Callable[[], None]] = None) -> None:
    """Wait on the host until the work queued on stream ``s`` is done: polls an event,
    calls ``check`` (the job's abort check) every 50 ms, raises
    :class:`~ddl.DDLTimeoutError` past ``deadline``. The data plane's kernels never wait
    for another process, so this only waits for work that is running."""
    if s.done:   # (an idle stream: a query, no event)
        return
    event = record_on(s)
    spins, next_check = 0, 0.0
    while not event.done:
        spins += 1
        if spins > 200:
            now = time.monotonic()
            if now >= deadline:
                raise DDLTimeoutError(f"device {what}: the GPU did not finish the data "
                                      f"plane's work before the deadline", op=what,
                                      timeout=0.0)
            if check is not None and now >= next_check:
                check()
                next_check = now + 0.05
            time.sleep(2e-5 if spins < 2000 else 2e-4)


def to_host(arr: Any, deadline: float, what: str) -> np.ndarray:
    """A host copy of the device array ``arr`` once the current stream's queued work is
    done (waited for with ``deadline``, as :func:`settle`)."""
    if arr.size:
        settle(cupy().cuda.get_current_stream(), deadline, what)
        return arr.get()
    return np.empty(0, arr.dtype)


_TO_F32 = None
_TO_BF16 = None


def _kernels():
    global _TO_F32, _TO_BF16
    if _TO_F32 is None:
        cp = cupy()
        # bfloat16 is the high half of a float32: widening is exact
        _TO_F32 = cp.ElementwiseKernel(
            "int16 x", "float32 y",
            "y = __int_as_float(((unsigned int)(unsigned short)x) << 16)", "ddl_bf16_to_f32")
        # round to nearest even, NaNs stay NaN (quiet), as ml_dtypes converts on the host
        _TO_BF16 = cp.ElementwiseKernel(
            "float32 x", "int16 y",
            """unsigned int u = __float_as_uint(x);
               if ((u & 0x7fffffffu) > 0x7f800000u) { y = (short)((u >> 16) | 0x40u); }
               else { y = (short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }""",
            "ddl_f32_to_bf16")
    return _TO_F32, _TO_BF16


def bf16_to_f32(x: Any, out: Any = None) -> Any:
    """float32 values of bfloat16 bytes held as int16 (exact), on the current stream."""
    return _kernels()[0](x, out) if out is not None else _kernels()[0](x)


def f32_to_bf16(x: Any, out: Any = None) -> Any:
    """bfloat16 bytes (as int16) of float32 values, rounded to nearest even."""
    return _kernels()[1](x, out) if out is not None else _kernels()[1](x)


def empty(count: int, dtype: np.dtype, device: int) -> Any:
    """An uninitialised 1-D device array of ``count`` elements (storage dtype), from
    CuPy's pool on ``device``. Call on the data plane's stream: the pool reuses memory
    in stream order."""
    _reclaim()
    cp = cupy()
    with cp.cuda.Device(device):
        return cp.empty(int(count), storage_dtype(dtype))


def current_device() -> int:
    """CuPy's current device in this thread."""
    return int(cupy().cuda.runtime.getDevice())


def device_info(device: int) -> Tuple[str, Tuple[str, ...]]:
    """``(id, ids of the GPUs device can access directly)`` as this process sees them;
    an id is the GPU's PCI bus id and UUID, the same in every process of its host."""
    cp = cupy()
    rt = cp.cuda.runtime

    def uuid(d: int) -> str:
        raw = rt.getDeviceProperties(d).get("uuid", b"")
        text = raw.hex() if isinstance(raw, (bytes, bytearray)) else str(raw)
        # CuPy reads the 16 bytes as a C string, cut at the first zero byte, so two
        # GPUs may share what is left; the PCI bus id (unique on a host) tells them apart
        return f"{rt.deviceGetPCIBusId(d)}/{text}"

    peers = tuple(uuid(d) for d in range(rt.getDeviceCount())
                  if d != device and rt.deviceCanAccessPeer(device, d))
    return uuid(device), peers


def loaded() -> bool:
    """Whether CuPy is imported already (without importing it)."""
    return "cupy" in sys.modules
