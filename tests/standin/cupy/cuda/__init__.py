"""``cupy.cuda`` of the stand-in: devices, streams and events that keep CuPy's per-thread
rules (the current device, ``with stream:``) but run nothing asynchronously (every
"kernel" has finished when its call returns, so an event is always done), and
``UnownedMemory`` / ``MemoryPointer`` over plain addresses."""

from __future__ import annotations

import itertools
from typing import Any, Optional

from . import _state, runtime

_ptrs = itertools.count(0x1000)


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
        return None

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id} (stand-in)>"


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    @property
    def done(self) -> bool:
        return True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


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
        return None

    def record(self, event: Optional[Event] = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    @property
    def done(self) -> bool:
        return True

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)


class Stream(_Stream):
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else (2 if ptds else next(_ptrs))
        self.device_id = _state.device()


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
