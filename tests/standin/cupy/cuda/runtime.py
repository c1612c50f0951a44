"""``cupy.cuda.runtime`` of the stand-in: devices from ``DDL_TEST_GPUS`` (default 1),
peer access between them where ``DDL_TEST_PEER_ACCESS=1``, and ``cudaMalloc`` /
CUDA IPC as POSIX shared memory: ``malloc`` maps a new file of ``/dev/shm`` (named
``ddl-standin-cuda-[<session>-]<pid>-<n>``, so the suite's leak check sees one that is
never freed), its IPC
handle is the file's name, and ``ipcOpenMemHandle`` maps it in another process; ``free``
poisons the bytes first, for the peers that still map them."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import mmap
import os
from typing import Dict, Tuple

from . import _state

cudaIpcMemLazyEnablePeerAccess = 1
_SHM = "/dev/shm"
_names = itertools.count()
_allocated: Dict[int, Tuple[str, mmap.mmap]] = {}
_opened: Dict[int, mmap.mmap] = {}


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int, what: str = ""):
        self.status = status
        super().__init__(f"cudaError {status}: {what}")


def getDeviceCount() -> int:
    return int(os.environ.get("DDL_TEST_GPUS", "1"))


def _check(device: int) -> int:
    if not 0 <= int(device) < getDeviceCount():
        raise CUDARuntimeError(101, f"invalid device ordinal {device}")
    return int(device)


def getDevice() -> int:
    return _state.device()


def setDevice(device: int) -> None:
    _state.local.device = _check(device)


def getDeviceProperties(device: int) -> dict:
    device = _check(device)
    return {"name": b"ddl stand-in GPU", "totalGlobalMem": 1 << 34,
            # CuPy reads the UUID's 16 bytes as a C string: cut at the first zero byte
            "uuid": hashlib.md5(f"ddl-standin-gpu-{device}".encode()).digest()
            .split(b"\0")[0]}


def deviceGetPCIBusId(device: int) -> str:
    return f"0000:{0x10 + _check(device):02x}:00.0"


def deviceCanAccessPeer(device: int, peer: int) -> bool:
    _check(device), _check(peer)
    return device != peer and os.environ.get("DDL_TEST_PEER_ACCESS") == "1"


def _map(fd: int, nbytes: int) -> Tuple[int, mmap.mmap]:
    mm = mmap.mmap(fd, nbytes)
    # the c_char's buffer export ends with the expression: no view holds the mapping open
    return ctypes.addressof(ctypes.c_char.from_buffer(mm)), mm


_SESSION = os.environ.get("DDLTEST_SESSION", "") + "-" if os.environ.get("DDLTEST_SESSION") \
    else ""


def malloc(nbytes: int) -> int:
    # with the test session's name (tests/conftest.py): its leak check counts only its own
    name = f"ddl-standin-cuda-{_SESSION}{os.getpid()}-{next(_names)}"
    fd = os.open(os.path.join(_SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(int(nbytes), 1))
        ptr, mm = _map(fd, max(int(nbytes), 1))
    finally:
        os.close(fd)
    _allocated[ptr] = (name, mm)
    return ptr


def free(ptr: int) -> None:
    """Free (unmap and unlink); first the bytes become 0xff (NaN as floats), since a
    peer that still maps the memory has no right to its values once it is freed (a
    GPU may give it to another allocation): late reads show."""
    name, mm = _allocated.pop(int(ptr))
    ctypes.memset(int(ptr), 0xFF, len(mm))
    mm.close()
    try:
        os.unlink(os.path.join(_SHM, name))
    except FileNotFoundError:
        pass


def ipcGetMemHandle(ptr: int) -> bytes:
    name, _ = _allocated[int(ptr)]
    return name.encode().ljust(64, b"\0")


def ipcOpenMemHandle(handle, flags: int = cudaIpcMemLazyEnablePeerAccess) -> int:
    name = bytes(handle).rstrip(b"\0").decode()
    fd = os.open(os.path.join(_SHM, name), os.O_RDWR)
    try:
        ptr, mm = _map(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    _opened[ptr] = mm
    return ptr


def ipcCloseMemHandle(ptr: int) -> None:
    _opened.pop(int(ptr)).close()
