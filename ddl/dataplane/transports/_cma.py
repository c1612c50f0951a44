"""Cross-memory attach: copy bytes straight out of another process's memory.

``process_vm_readv(2)`` (Linux 3.2+) copies from a range of another process's address
space into this one's in a single pass, without the other process taking part: one copy
where going through a shared segment takes two (the owner's copy in, the reader's copy
out). The kernel allows it only where the reader could ``ptrace`` the owner (same user,
and Yama's ``ptrace_scope`` or a container's seccomp profile permitting), so a caller
must probe first; :class:`~ddl.dataplane.transports.shm.ShmGroup` does, once per group.

:func:`read` raises :class:`OSError` with the errno: ``ESRCH`` (the process is gone),
``EFAULT`` (the range is not mapped there), ``EPERM`` (not allowed).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np

# Bytes per system call: the kernel pins the source pages of one call at a time; a bounded
# piece keeps each call short, so the caller can look at its deadline between pieces.
PIECE_BYTES = 16 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()
AVAILABLE = _readv is not None   # the call exists here; whether it is allowed needs a probe


def read(pid: int, address: int, dst: np.ndarray, start: int = 0, stop: int = -1) -> None:
    """Copy bytes ``start:stop`` of ``dst`` (1-D uint8) from ``address + start`` in
    process ``pid``; ``stop`` -1 means to the end. Raises :class:`OSError` on failure."""
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this system")
    stop = dst.nbytes if stop < 0 else stop
    base = dst.ctypes.data
    local, remote = _Iovec(), _Iovec()
    at = start
    while at < stop:
        n = min(stop - at, PIECE_BYTES)
        local.iov_base, local.iov_len = base + at, n
        remote.iov_base, remote.iov_len = address + at, n
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:   # a partial read ends where the remote mapping ends
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid}: no bytes at "
                                        f"{address + at:#x}")
        at += got
