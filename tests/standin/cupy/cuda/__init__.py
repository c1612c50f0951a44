"""``cupy.cuda`` of the stand-in: devices, streams and events that keep CuPy's per-thread
rules (the current device, ``with stream:``), and ``UnownedMemory`` / ``MemoryPointer``
over plain addresses.

By default every "kernel" has finished when its call returns, so an event is always done.
With ``DDL_TEST_LAZY_STREAMS=1`` streams are queues instead: the array operations of
:mod:`cupy` are queued on the current stream and run only when something waits for
them (an event's ``done`` or ``synchronize`` runs its stream up to the event, a stream
that waits for an event runs the event's stream up to it when it gets there, a host read
such as ``get()`` runs the current stream), as if the GPU ran nothing until waited for.
Work that a program forgets to order then reads stale memory, which results show.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from typing import Any, Callable, Dict, Optional

from . import _state, runtime

LAZY = os.environ.get("DDL_TEST_LAZY_STREAMS") == "1"
_WAIT_S = 120.0
_ptrs = itertools.count(0x1000)


class _Queue:
    """One stream's work (all the stream objects of one handle share it): ``enqueued``
    operations so far, ``done`` of them run, in order, by one thread at a time."""

    def __init__(self):
        self.cond = threading.Condition()
        self.pending: collections.deque = collections.deque()
        self.enqueued = self.done = 0
        self.running = False

    def put(self, fn: Callable[[], None]) -> None:
        if not LAZY:
            fn()
            return
        with self.cond:
            self.pending.append(fn)
            self.enqueued += 1

    def run_until(self, target: int) -> None:
        """Run this stream's operations until ``target`` of them are done (other streams'
        only as its waits need them: never while holding this one's lock). Waiting for
        another thread that runs them ends with RuntimeError after ``_WAIT_S``."""
        deadline = time.monotonic() + _WAIT_S
        while True:
            with self.cond:
                if self.done >= target:
                    return
                if self.running:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"stand-in stream: another thread has run this "
                                           f"stream's work for over {_WAIT_S:g} s")
                    self.cond.wait(0.05)
                    continue
                fn = self.pending.popleft()
                self.running = True
            try:
                fn()
            finally:
                with self.cond:
                    self.done += 1
                    self.running = False
                    self.cond.notify_all()

    def run_all(self) -> None:
        self.run_until(self.enqueued)


_queues: Dict[int, _Queue] = {}
_queues_lock = threading.RLock()   # (a pool block's release may run in a GC here)


def _queue(ptr: int) -> _Queue:
    with _queues_lock:
        found = _queues.get(int(ptr))
        if found is None:
            found = _queues[int(ptr)] = _Queue()
        return found


def current_queue() -> _Queue:
    """The current stream's queue (where array operations go)."""
    return _queue(get_current_stream().ptr)


def flush_stream(ptr: int) -> None:
    """Run everything queued so far on the stream whose handle is ``ptr``."""
    _queue(ptr).run_all()


class Device:
    def __init__(self, device: Optional[int] = None):
        self.id = _state.device() if device is None else runtime._check(device)
        self._saved: list = []

    def use(self) -> None:
        _state.local.device = self.id

    def __enter__(self) -> "Device":
        self._saved.append(_state.device())
        self.use()
        return self

    def __exit__(self, *exc) -> bool:
        _state.local.device = self._saved.pop()
        return False

    def synchronize(self) -> None:
        for ptr in list(_queues):
            _queue(ptr).run_all()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    __hash__ = None   # as CuPy's (a compiled class with comparisons and no hash)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id} (stand-in)>"


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self._queue: Optional[_Queue] = None
        self._target = 0
        self._device = _state.device()   # an event belongs to the device current then

    def record(self, stream: Any = None) -> None:
        s = stream if stream is not None else get_current_stream()
        if s.ptr not in (0, 1, 2) and s.device_id != self._device:
            # as CUDA: an event records only on a stream of its own device
            raise runtime.CUDARuntimeError(
                400, f"cudaErrorInvalidResourceHandle: an event of device {self._device} "
                     f"recorded on a stream of device {s.device_id}")
        q = _queue(s.ptr)
        with q.cond:
            self._queue, self._target = q, q.enqueued

    def _reach(self) -> None:
        if self._queue is not None:
            self._queue.run_until(self._target)

    @property
    def done(self) -> bool:
        self._reach()
        return True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self._reach()


class _Stream:
    ptr = 0
    device_id = 0

    def __enter__(self) -> "_Stream":
        _state.streams().append(self)
        return self

    def __exit__(self, *exc) -> bool:
        _state.streams().pop()
        return False

    def use(self) -> "_Stream":
        stack = _state.streams()
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def wait_event(self, event: Event) -> None:
        q, target = event._queue, event._target
        if q is not None and q is not _queue(self.ptr):
            _queue(self.ptr).put(lambda: q.run_until(target))

    def record(self, event: Optional[Event] = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _queue(self.ptr).run_all()

    @property
    def done(self) -> bool:
        self.synchronize()
        return True

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)


class Stream(_Stream):
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else (2 if ptds else next(_ptrs))
        # as CuPy's: a default stream belongs to no device (it means the current one's)
        self.device_id = -1 if null or ptds else _state.device()


class ExternalStream(_Stream):
    def __init__(self, ptr: int, device_id: int = -1):
        self.ptr = int(ptr)
        self.device_id = _state.device() if device_id < 0 else int(device_id)


_NULL = Stream(null=True)


def get_current_stream(device_id: int = -1) -> _Stream:
    stack = _state.streams()
    return stack[-1] if stack else _NULL


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1):
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        self.device_id = _state.device() if device_id < 0 else int(device_id)


class MemoryPointer:
    def __init__(self, mem: Any, offset: int):
        self.mem = mem
        self.ptr = (mem.ptr if mem is not None else 0) + int(offset)
        self.device_id = mem.device_id if mem is not None else _state.device()

    def __int__(self) -> int:
        return self.ptr
